"""Where a served decode's time goes: py-spy stacks of `engine serve --experts resident` during one long stream.

  OUT=DIR python3 bench/served_profile.py      # on the device, after bench/h200_served.py made /tmp/kb

A diagnosis, not a benchmark: py-spy (carried as a wheel; --nonblocking, 400 Hz) samples every thread for 4 s
(--idle: waits too) and then only the GIL holder (--gil), while a 5,000-token greedy stream decodes; before it,
a plain 96-token stream's rate with nothing attached (h200_served's client and figures). Writes DIR/prof.json
and DIR/prof-{all,gil}.txt (py-spy's raw collapsed stacks). Results: results/2026-12-01-h200-served-profile*.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import completions_client, free_port, prompt_ids, stop, summarize, wait_ready, run_stream

out = Path(os.environ["OUT"])
model, store = "/tmp/kb/model", "/tmp/kb/store"
port = free_port()
base = f"http://127.0.0.1:{port}"
log = out / "prof-serve.log"
proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", model, "--store", store, "--device", "cuda",
                         "--port", str(port), "--ctx", "8704", "--max-batch", "4", "--served-name", "synth",
                         "--log-level", "warning", "--experts", "resident"], stdout=open(log, "w"),
                        stderr=subprocess.STDOUT, start_new_session=True)
res = {}
try:
    res["load_s"] = wait_ready(proc, base, log, "serve")
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    make = completions_client(base, "synth", [])
    for i in range(2):
        o = {}
        run_stream(make(prompt_ids(128, vocab, 100 + i), 64, 0.0, i), o)
    o1 = {}
    run_stream(make(prompt_ids(128, vocab, 1), 96, 0.0, 1), o1)
    res["plain_1_stream"] = summarize([o1])
    pid = proc.pid
    long = {}
    t = threading.Thread(target=run_stream, args=(make(prompt_ids(128, vocab, 2), 5000, 0.0, 2), long))
    t.start()
    time.sleep(2)
    for name, extra in (("all", ["--idle"]), ("gil", ["--gil"])):
        r = subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", "4", "--rate", "400", "--threads",
                            "--nonblocking", "-f", "raw", "-o", str(out / f"prof-{name}.txt"), *extra],
                           capture_output=True, text=True)
        res[f"pyspy_{name}_rc"] = r.returncode
        res[f"pyspy_{name}_tail"] = (r.stdout + r.stderr)[-600:]
    t.join()
    res["profiled_stream"] = summarize([long])
finally:
    stop(proc)
(out / "prof.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2)[:3000])
