"""What building a chat request costs before the engine sees it: the template rendered, the prompt tokenized, the
system prefix tokenized (n_keep), the next turn's opening, for chats revisited after a user's pause.

The workload bench's revisits in process: 8 chats, each with its own ~830-token system prompt, through the request
builder with the gemma template on an engine of 4 slots; every chat's first turn (16 tokens generated), then every
chat's second turn, a pause of --gap seconds before each. Prints the median time of `RequestBuilder.chat` for the
first turns and for the revisits. Compare two versions of the code by running it with each on PYTHONPATH.

    python tests/bench/chat_build.py [--model GGUF] [--rounds N] [--gap S]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from next_turn import WORDS, chat_args

from localllm.compose.formats import builtin_format
from localllm.compose.requests import Options, RequestBuilder
from localllm.runtime.engine.scheduler import Engine


def main() -> None:
    model, rounds, gap = chat_args(__doc__)
    firsts: list[float] = []
    agains: list[float] = []
    with Engine(model, n_ctx=16384, slots=4, threads=2) as e:
        build = RequestBuilder(builtin_format("gemma", e.model), e)
        opts = Options({"temperature": 0}, max_tokens=16)

        def ask(msgs: list[dict[str, str]], sink: list[float]) -> str:
            time.sleep(gap)
            t0 = time.perf_counter()
            req = build.chat(msgs, opts).request
            sink.append((time.perf_counter() - t0) * 1000)
            return e.generate(req).text

        for r in range(rounds):
            rng = random.Random(f"{time.time()}-{r}")
            chats = [[{"role": "system", "content": f"Session {r}, chat {i}: you answer questions about this text.\n"
                       + " ".join(rng.choice(WORDS) for _ in range(700))},
                      {"role": "user", "content": f"What is chat {i} about?"}] for i in range(8)]
            replies = [ask(c, firsts) for c in chats]
            for c, reply in zip(chats, replies, strict=True):
                c += [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "Which part would you read first, and why?"}]
                ask(c, agains)
    print(f"RequestBuilder.chat, median of {len(firsts)} first turns: {statistics.median(firsts):.2f} ms; "
          f"of {len(agains)} revisits: {statistics.median(agains):.2f} ms")


if __name__ == "__main__":
    main()
