"""Step time with the blocked CPU attention kernel routed on vs off (PADDLETUNE_BLOCKED_ATTENTION=0:
the dense path everywhere), compare_peers.py's paddletune row, alternating runs, each its own process.

    PYTHONPATH=. python benchmarks/attention_step_ab.py [--pairs 4] [--modes lora] [--first on] [--smoke]

Every pair runs `compare_peers.py --peers paddletune --runs 1 --modes MODE` once with the kernel on
and once off (the order alternates from pair to pair, starting with --first); prints the target
tokens/s of every run, the medians and on / off. Losses are printed per run: the two paths agree
to float32 rounding, so a differing loss means a broken run, not a faster one. --smoke: compare_peers'
tiny model (script check).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def one_run(mode, kernel, smoke=False):
    env = dict(os.environ, PADDLETUNE_BLOCKED_ATTENTION="1" if kernel else "0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(HERE, "compare_peers.py"), "--peers", "paddletune", "--runs", "1",
                        "--modes", mode] + (["--smoke"] if smoke else []), env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 8 and cells[0] == mode and cells[1] == "paddletune":
            return float(re.match(r"[\d.]+", cells[4]).group()), cells[8]
    raise SystemExit(f"compare_peers.py gave no paddletune {mode} row (exit {r.returncode}):\n{r.stderr[-2000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--modes", default="lora")
    p.add_argument("--first", default="on", choices=("on", "off"))
    p.add_argument("--smoke", action="store_true", help="compare_peers.py --smoke runs (script check)")
    o = p.parse_args()
    load = os.getloadavg()
    print(f"`python benchmarks/attention_step_ab.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\nload average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; target tokens/s per run\n")
    print("| mode | kernel on (runs) | kernel off (runs) | on median | off median | on / off | loss step 1 / last, on; off |")
    print("|---|---|---|---|---|---|---|")
    for mode in o.modes.split(","):
        got = {True: [], False: []}
        loss = {}
        for i in range(o.pairs):
            order = [True, False] if (i % 2 == 0) == (o.first == "on") else [False, True]
            for kernel in order:
                tps, loss[kernel] = one_run(mode, kernel, o.smoke)
                got[kernel].append(tps)
                print(f"[{mode} pair {i + 1}/{o.pairs}] kernel {'on' if kernel else 'off'}: {tps:.0f} target tokens/s",
                      file=sys.stderr, flush=True)
        on, off = statistics.median(got[True]), statistics.median(got[False])
        print(f"| {mode} | {', '.join(f'{x:.0f}' for x in got[True])} | {', '.join(f'{x:.0f}' for x in got[False])} "
              f"| {on:.0f} | {off:.0f} | {on / off:.3f} | {loss[True]}; {loss[False]} |", flush=True)


if __name__ == "__main__":
    main()
