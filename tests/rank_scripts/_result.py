"""How a rank script hands its result to the test: ``emit({"rank": r, ...})``.

Under `tests/support.run_ranks` (which sets ``HVD_BALANCE_TEST_RESULTS`` to a fresh
folder) the object goes to ``<folder>/rank<r>.json``, written whole and then renamed, so a
large result never travels through horovodrun's output forwarding: that forwards a rank's
output in chunks, and a line longer than a chunk came back with another rank's output in
the middle of it. Run by hand, the script prints ``RESULT <json>`` instead.
"""

import json
import os

RESULTS_DIR_VAR = "HVD_BALANCE_TEST_RESULTS"


def emit(result: dict) -> None:
    """Hands ``result`` (a JSON-serialisable dict with a ``"rank"``) to the test."""
    text = json.dumps(result)
    folder = os.environ.get(RESULTS_DIR_VAR)
    if not folder:
        print("RESULT " + text, flush=True)
        return
    path = os.path.join(folder, f"rank{int(result['rank'])}.json")
    partial = f"{path}.{os.getpid()}.tmp"  # a restarted rank may write beside its old self
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)
    print(f"RESULT written to {path}", flush=True)
