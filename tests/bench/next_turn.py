"""Chats revisited with their next turn opened ahead (Request.next_turn) or not: TTFT of the revisits.

8 chats, each with its own ~830-token system prompt, on 4 slots (the workload bench's revisits), through the request
builder with the gemma template: every chat's first turn in order, then every chat's second turn in the same order,
a pause of --gap seconds before each request (a user reading and typing). Each round runs both sides on fresh
engines, alternating which goes first: "ahead" as the builder makes requests, "off" with next_turn emptied.
Prints per round the revisits' TTFT p50, the prompt tokens each revisit prefilled, and the ratio ahead / off.

    python tests/bench/next_turn.py [--model GGUF] [--rounds N] [--gap S]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import starter_model

from localllm.compose.formats import builtin_format
from localllm.compose.requests import Options, RequestBuilder
from localllm.runtime.engine.scheduler import Engine

WORDS = ["river", "stone", "cloud", "garden", "market", "lantern", "copper", "harbor", "meadow", "thunder",
         "winter", "orchard", "signal", "parser", "socket", "buffer", "kernel", "thread", "module", "cache"]


def side(model: Path, tag: str, ahead: bool, gap: float) -> tuple[float, float, list[str]]:
    """(TTFT p50 of the revisits in ms, prompt tokens each prefilled (median), every reply)."""
    rng = random.Random(tag)
    systems = [f"Session {tag}, chat {i}: you answer questions about this text.\n"
               + " ".join(rng.choice(WORDS) for _ in range(700)) for i in range(8)]
    with Engine(model, n_ctx=16384, slots=4, threads=2) as e:
        build = RequestBuilder(builtin_format("gemma", e.model), e)
        opts = Options({"temperature": 0}, max_tokens=16)

        def ask(msgs: list[dict[str, str]]) -> tuple[str, float, int]:
            time.sleep(gap)
            req = build.chat(msgs, opts).request
            if not ahead:
                req.next_turn = []
            r = e.generate(req)
            return r.text, r.timings.ttft_ms, r.usage.prompt_tokens - r.usage.cached_tokens

        chats = [[{"role": "system", "content": s}, {"role": "user", "content": f"What is chat {i} about?"}]
                 for i, s in enumerate(systems)]
        replies = [ask(c)[0] for c in chats]
        again = []
        for c, reply in zip(chats, replies, strict=True):
            c += [{"role": "assistant", "content": reply},
                  {"role": "user", "content": "Which part would you read first, and why?"}]
            again.append(ask(c))
    return (statistics.median(x[1] for x in again), statistics.median(x[2] for x in again),
            replies + [x[0] for x in again])


def chat_args(doc: str | None) -> tuple[Path, int, float]:
    """--model (default: the starter gemma-3-270m), --rounds, --gap: the revisited chats' benches' arguments."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: the starter gemma-3-270m)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds before each request")
    a = ap.parse_args()
    return (Path(a.model) if a.model else starter_model()), a.rounds, a.gap


def main() -> None:
    model, rounds, gap = chat_args(__doc__)
    nonce = f"{time.time():.0f}"
    print(f"{'round':>5} {'ahead ms':>9} {'off ms':>7} {'ratio':>6} {'prefilled ahead/off':>20} {'replies equal':>14}")
    ratios = []
    for r in range(rounds):
        tag = f"{nonce}-{r}"
        got = {}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            got[on] = side(model, tag, on, gap)
        (t_on, n_on, x_on), (t_off, n_off, x_off) = got[True], got[False]
        ratios.append(t_on / t_off)
        same = sum(p == q for p, q in zip(x_on, x_off, strict=True))
        print(f"{r:>5} {t_on:>9.0f} {t_off:>7.0f} {ratios[-1]:>6.2f} {f'{n_on:.0f} / {n_off:.0f}':>20} "
              f"{f'{same}/{len(x_on)}':>14}")
    print(f"median ratio ahead / off: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
