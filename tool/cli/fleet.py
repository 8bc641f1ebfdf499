"""`tool fleet-wait`: the head of a fleet waits for its workers (the head unit's ExecStartPre; systemd cannot
order units across machines), and fails with one line naming the first worker that did not answer."""
from __future__ import annotations

import click

from tool.fleet import Peer, parse_peer, wait_for


class PeerParam(click.ParamType):
    name = "NAME=ADDR:PORT"

    def convert(self, value, param, ctx) -> Peer:
        try:
            return parse_peer(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@click.command("fleet-wait")
@click.argument("workers", nargs=-1, required=True, type=PeerParam())
@click.option("--timeout", type=click.FloatRange(min=0), default=300, show_default=True,
              help="Seconds to wait for every worker (a fleet recipe's fleet.workers_timeout_s).")
def fleet_wait(workers, timeout):
    """Wait until every WORKER (NAME=ADDR:PORT) accepts a connection on its fleet address.

    Exit codes: 0 every worker answered, 7 one did not within --timeout (the line names it).
    """
    took = wait_for(list(workers), timeout)
    click.echo(f"{len(workers)} fleet worker{'s' if len(workers) != 1 else ''} answered in {took:.1f} s: "
               + ", ".join(str(w) for w in workers))
