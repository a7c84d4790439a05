"""Summary of run.sh's histories (one or more OUT_DIRs): every round per run, and what became of
each change made at epoch 0's round, whose trial ran in the first slow window."""
import glob, json, sys
for v in ("old", "new"):
    coinc = []
    for f in sorted(f for d in sys.argv[1:] for f in glob.glob(f"{d}/co_{v}_*.json")):
        try:
            h = json.load(open(f))
        except ValueError:
            continue
        line = " | ".join(f"e{x['epoch']}{'C' if x['changed'] else ''}{'R' if x['reverted'] else ''} "
                          f"{x['batch_sizes']} {x['step_ms']:.1f}" for x in h)
        print(v, f.split("/")[-2], f.split("/")[-1], line)
        k = max(i for i, x in enumerate(h) if x["epoch"] == 0)  # epoch 0's last round
        if h[k]["changed"]:  # its trial ran in the first slow window, judged at epoch 1's round
            coinc.append(f"{h[k]['batch_sizes']} {'undone' if h[k + 1]['reverted'] else 'kept'}: "
                         f"rank 1 {h[k]['batch_sizes'][1]} -> {h[k + 1]['batch_sizes'][1]}")
    print(v, "epoch-0 changes and their verdict in the first slow window:", coinc)
