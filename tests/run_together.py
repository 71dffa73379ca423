"""Run several recipes one after another in the same processes: `torchrun --nproc_per_node N
tests/run_together.py RUNS.json`, RUNS.json holding [[recipe script, [flags], {environment}], ...].
Each rank executes every recipe as __main__ with its flags and those environment variables set, as
`ENV=... python recipe.py FLAGS` would, and writes RUNS.json.rank<R> with each run's exit status.
The tests use it so that torchrun and its ranks' imports start once for all the runs a test module
makes (each start costs seconds on 2 cores)."""

import json
import logging
import os
import runpy
import signal
import sys
import traceback

plan = sys.argv[1]
codes = []
for script, flags, env in json.loads(open(plan).read()):
    sys.argv, saved_env = [script, *flags], dict(os.environ)
    os.environ.update(env)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}  # StopSignal sets its own
    print(f"=== {os.path.basename(script)} {' '.join(flags)}", flush=True)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # usage_errors' status, tyro's exit
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    for s, handler in handlers.items():
        signal.signal(s, handler)
    logging.getLogger().handlers.clear()  # the next run's setup_logging installs its own
    os.environ.clear()
    os.environ.update(saved_env)
    codes.append(code)
    sys.stdout.flush()
with open(f"{plan}.rank{os.environ.get('RANK', '0')}", "w") as f:
    json.dump(codes, f)
# A process group a run left (a test's own script) is closed on every rank together: torn down by
# the interpreter's exit instead, one rank's gloo threads can abort when the other is already gone.
if "torch.distributed" in sys.modules:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
