"""`tool plan RECIPE`: the recipe compiled by nix/lib: each step's command and limits, or the whole plan as JSON."""
from __future__ import annotations

import ipaddress
import json

import click

from tool import plan as plans
from tool.errors import printable
from tool.recipes import load
from tool.state import DEFAULT_STATE_DIR


class BindAddress(click.ParamType):
    """An IP address literal (IPv4 or IPv6): docker's -p and the engine's --host take nothing else, and a
    unit file or argv must never receive a word the operator did not mean as an address."""

    name = "ADDRESS"

    def convert(self, value, param, ctx):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            self.fail(f"{printable(repr(value))} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)", param, ctx)


class FleetAddress(click.ParamType):
    """NAME=ADDRESS:PORT, a fleet host's place on the fleet network (IPv6 in brackets): the operator's, never the
    recipe's. The address is an IP literal; nix/lib refuses 0.0.0.0/:: without --unauthenticated-port-on-all-addresses."""

    name = "NAME=ADDR:PORT"

    def convert(self, value, param, ctx):
        name, eq, where = value.partition("=")
        host, colon, port = where.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            address = ipaddress.ip_address(bare)
            number = int(port)
        except ValueError:
            address = number = None
        if not (eq and name and colon and address is not None and 1 <= number <= 65535
                and (address.version == 6) == host.startswith("[")):
            self.fail(f"{printable(repr(value))} is not NAME=ADDRESS:PORT (e.g. worker-a=10.0.0.2:50052, "
                      "worker-b=[fd00::2]:50052)", param, ctx)
        return name, f"[{address}]:{number}" if address.version == 6 else f"{address}:{number}"


def _fleet_addresses(ctx, param, value):
    """Repeated --fleet-address flags → {name: "ADDR:PORT"}; None when none was given (nix/lib's defaults)."""
    if not value:
        return None
    out: dict[str, str] = {}
    for name, where in value:
        if name in out:
            raise click.BadParameter(f"host {printable(repr(name))} is given twice", param=param)
        out[name] = where
    return out


def fleet_options(f):
    """A fleet recipe's host and the operator's addresses (plan, materialise, preflight, up): nix/lib options."""
    return click.option("--host", "host", default=None, metavar="NAME",
                        help="A fleet recipe: the host to act for (default: its head); only that host's units.")(
        click.option("--fleet-address", "fleetAddresses", type=FleetAddress(), multiple=True,
                     callback=_fleet_addresses, help="A fleet host's address and port on the fleet network, "
                     "NAME=ADDR:PORT (repeat per host; default 127.0.0.1 and consecutive ports); the operator's, "
                     "never the recipe's.")(
            click.option("--unauthenticated-port-on-all-addresses", "unauthenticatedPortOnAllAddresses",
                         is_flag=True, default=None, help="Let a fleet address be 0.0.0.0 or ::, though a worker's "
                         "port (rpc-server, Ray) takes commands from anyone who reaches it.")(f)))


def plan_options(f):
    """Flags shared by `plan` and `materialise`: every one overrides a nix/lib option."""
    f = fleet_options(f)
    for decl, kw in reversed([
        (("--state-dir", "stateDir"), dict(type=click.Path(), help=f"Kiln's state directory (default {DEFAULT_STATE_DIR}).")),
        (("--models-dir", "modelsDir"), dict(type=click.Path(), help="Where weights live (default STATE_DIR/models).")),
        (("--store-dir", "storeDir"), dict(type=click.Path(), help="Where prepared stores live (default STATE_DIR/stores).")),
        (("--port", "port"), dict(type=click.IntRange(1, 65535), help="Host port the server publishes (default: the recipe's).")),
        (("--bind", "bindAddress"), dict(type=BindAddress(), help="IP address the server binds on the host "
                                          "(default 127.0.0.1); the operator's, never the recipe's.")),
        (("--uid", "uid"), dict(type=click.IntRange(0), help="Service user's uid (default: the kiln user's, else yours).")),
        (("--gid", "gid"), dict(type=click.IntRange(0), help="Service user's gid (default: the kiln user's, else yours).")),
        (("--tool-bin", "toolBin"), dict(help="The `tool` program units run (default: tool).")),
        (("--engine-bin", "engineBin"), dict(help="The `engine` program native units run (default: engine).")),
        (("--docker-bin", "dockerBin"), dict(help="The docker client container units run (default /usr/bin/docker).")),
        (("--llama-server-bin", "llamaServerBin"), dict(help="llama.cpp's server llama-cpp units run (default: llama-server).")),
        (("--rpc-server-bin", "rpcServerBin"), dict(help="llama.cpp's rpc-server a fleet's workers run (default: rpc-server).")),
        (("--environment-file", "environmentFile"), dict(help="KEY=VALUE secrets file (KILN_API_KEY, HF_TOKEN) for every "
                                                          "unit (EnvironmentFile=) and container (--env-file).")),
    ]):
        f = click.option(*decl, default=None, **kw)(f)
    return f


def options_from(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


@click.command("plan")
@click.argument("recipe")
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON.")
@plan_options
def plan(recipe, as_json, **kwargs):
    """Compile RECIPE (an id or a path) with Nix and print each step's command and limits."""
    compiled = plans.compile_plan(load(recipe), options_from(kwargs))
    if as_json:
        click.echo(json.dumps(compiled, indent=2, sort_keys=True))
    else:
        click.echo(plans.render(compiled), nl=False)
