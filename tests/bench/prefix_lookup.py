"""What finding a prompt's longest saved prefix costs, by how many states the RAM and disk tiers hold.

    python tests/bench/prefix_lookup.py [--history 5000] [--states 50,200,800] [--repeat 20] [--chats 1]

Every request looks its prompt up in both tiers before it is admitted. The states are those a busy session
leaves: each shares a long history (a system prompt, a document, an agent's transcript) and goes on with its own
turn, and a sliding-window model leaves checkpoints cut 32, 128 and 512 tokens before each end. With --chats N the
states come from N such histories (other chats, other sessions' prompts), the prompt continuing the first. Prints the median
milliseconds of one lookup per tier. To compare two versions, run this file with each on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from localllm.runtime.cache.disk import DiskStates
from localllm.runtime.cache.prefix import StateLRU


def _states(history: int, n: int, chats: int = 1) -> tuple[list[tuple[int, ...]], list[int]]:
    rng = random.Random(0)
    bases = [[rng.randrange(1, 200_000) for _ in range(history)] for _ in range(chats)]
    keys: list[tuple[int, ...]] = []
    while len(keys) < n:
        turn = bases[len(keys) // 4 % chats] + [rng.randrange(1, 200_000) for _ in range(rng.randint(40, 400))]
        keys += [tuple(turn[:len(turn) - cut]) for cut in (0, 32, 128, 512)]
    prompt = bases[0] + [rng.randrange(1, 200_000) for _ in range(60)]
    return keys[:n], prompt


def _time(f: object, prompt: list[int], repeat: int) -> float:
    xs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f.best(prompt)  # type: ignore[attr-defined]
        xs.append(1000 * (time.perf_counter() - t0))
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=5000)
    ap.add_argument("--states", default="50,200,800")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--chats", type=int, default=1, help="histories the states come from")
    args = ap.parse_args()
    print(f"{'states':>7} {'RAM ms':>8} {'disk ms':>8}   ({args.chats} histories of {args.history} tokens, "
          f"median of {args.repeat})")
    for n in (int(x) for x in args.states.split(",")):
        keys, prompt = _states(args.history, n, args.chats)
        ram = StateLRU(1 << 40)
        for k in keys:  # each turn whole before its cuts: no state is a prefix of a later one (put keeps them all)
            ram.put(k, b"x", 0)
        with tempfile.TemporaryDirectory() as d:
            disk = DiskStates(d, 1 << 40, min_tokens=1)
            for k in keys:
                disk.put(k, b"x" * 64, 0)
            disk.close(60)
            disk = DiskStates(d, 1 << 40, min_tokens=1)  # its index read back from the files, as after a restart
            print(f"{n:>7} {_time(ram, prompt, args.repeat):>8.2f} {_time(disk, prompt, args.repeat):>8.2f}")
            disk.close(1)


if __name__ == "__main__":
    main()
