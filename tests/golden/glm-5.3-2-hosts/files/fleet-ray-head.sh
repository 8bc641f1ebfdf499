#!/bin/bash
# Kiln fleet head: start the Ray head on this host's fleet address, wait until every worker's GPUs joined
# (TP x PP of them), naming the worker that did not, then run the seed's server on the cluster.
set -euo pipefail
ray start --head --node-ip-address="$KILN_FLEET_HOST" --port="$KILN_FLEET_PORT" \
  --dashboard-host=127.0.0.1 --include-dashboard=false --disable-usage-stats
python3 - <<'PY'
import os, sys, time
import ray
want = int(os.environ["TP"]) * int(os.environ["PP"])
workers = dict(w.split("=", 1) for w in os.environ["KILN_FLEET_WORKERS"].split(",") if w)
deadline = time.monotonic() + int(os.environ["KILN_FLEET_TIMEOUT_S"])
ray.init(address="auto", logging_level="ERROR")
while True:
    alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus >= want:
        break
    if time.monotonic() > deadline:
        missing = [f"{name} ({addr})" for name, addr in sorted(workers.items()) if addr.rsplit(":", 1)[0] not in alive]
        sys.exit(f"kiln: fleet worker {', '.join(missing) or '?'} did not join the Ray cluster within "
                 f"{os.environ['KILN_FLEET_TIMEOUT_S']} s ({gpus} of {want} GPUs)")
    time.sleep(2)
PY
exec /opt/local-ai/glm53-tuned-entrypoint.sh "$@"
