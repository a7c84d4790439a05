"""Every revert recorded in docs/bench: would Trial.step_before_now's rule undo it too?
Run from the repository root: python docs/bench/trial_in_slowdown/replay.py"""
import gzip, json, glob
def hists(o):
    if isinstance(o, dict):
        for v in o.values():
            if isinstance(v, list) and v and isinstance(v[0], dict) and "reverted" in v[0] and "busy_ms" in v[0]:
                yield v
            else:
                yield from hists(v)
    elif isinstance(o, list):
        for v in o: yield from hists(v)
for f in sorted(glob.glob('docs/bench/**/*.json.gz', recursive=True)):
    d = json.load(gzip.open(f))
    for h in hists(d):
        for i, r in enumerate(h):
            if not r.get("reverted"): continue
            # the round that decided the trial (its busy/step are the plan before's), before
            # any round that ran the trial one window more (then the two windows' mean judges)
            extended = i >= 2 and h[i - 1].get("extended")
            t = h[i - 2] if extended else h[i - 1]
            margin = 0.0 if t.get("explored") or t.get("offloaded") else 0.05
            # Trial.step_before_now: a rank whose batch did not grow and whose busy time rose
            # beyond the window's noise allowance (2x its largest relative standard error) has
            # slowed; the plan before would have paid that too
            allowance = 2 * max(r.get("busy_rse") or [0.0])
            bound = max(mn if b1 <= b0 and mn > mo * (1 + allowance) else mo for mo, mn, b0, b1
                        in zip(t["busy_ms"], r["busy_ms"], r["batch_sizes"], t["batch_sizes"]))
            now = t["step_ms"] + max(0.0, bound - max(t["busy_ms"]))
            if extended:  # the first window's re-timing is approximated by this one's
                r = dict(r, step_ms=(h[i - 1]["step_ms"] + r["step_ms"]) / 2)
            verdict = r["step_ms"] > (1 + margin) * now
            if margin == 0 and not extended and abs(r["step_ms"] - now) <= 0.05 * now:
                verdict = "no: today one window more (Rounds.next: within UNDO_MARGIN)"
            print(f"{f.split('/')[-1]:58s} epoch {r['epoch']} {'tried' if margin == 0 else 'busy '} "
                  f"before {t['step_ms']:6.1f} re-timed {now:6.1f} trial {r['step_ms']:6.1f} ms: "
                  f"undone {verdict}; busy after / before per rank "
                  f"{[round(a / b, 3) for a, b in zip(r['busy_ms'], t['busy_ms'])]}")
