"""A plan: what the request builder hands a door. The runtime Request (what the engine runs: tokens,
sampling, stops, the context policy) plus what belongs above the runtime: how to read the reply, what
the builder did to fit the context, the stop rules llama.cpp's /infill adds, and the tokens that close
a reasoning block when its budget is spent. compose/pipeline.py carries a plan through an engine."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, replace

from localllm.compose.reply import ReplyFormat
from localllm.runtime.types import Notice, Request


@dataclass
class TextLimits:
    """llama-server's n_indent and t_max_predict_ms, applied to the text as it grows (its /infill)."""

    n_indent: int = 0
    t_max_ms: int | None = None
    t0: float | None = None  # the clock starts with the first generated text, as in llama-server

    def cut(self, text: str) -> str | None:
        """The text to keep when a limit is hit, else None."""
        if self.t0 is None:
            self.t0 = time.perf_counter()
        if self.n_indent > 0 and "\n" in text:
            start = 0
            while (nl := text.find("\n", start)) >= 0:
                line = text[nl + 1:]
                stripped = line.lstrip(" \t")
                # a line that has begun (not just whitespace) and sits left of the cursor's indent
                if stripped and "\n" not in line[: len(line) - len(stripped)] \
                        and len(line) - len(stripped) < self.n_indent:
                    return text[: nl + 1]
                start = nl + 1
        if self.t_max_ms and self.t_max_ms > 0 and "\n" in text \
                and (time.perf_counter() - self.t0) * 1000 > self.t_max_ms:
            return text
        return None

    @property
    def active(self) -> bool:
        return self.n_indent > 0 or bool(self.t_max_ms and self.t_max_ms > 0)


@dataclass
class Plan:
    request: Request
    reply: ReplyFormat | None = None  # reasoning markers, tool-call syntax, the reasoning budget
    notices: list[Notice] = field(default_factory=list)  # what the builder dropped to fit (oldest turns)
    close_reasoning: list[int] = field(default_factory=list)  # the close marker's tokens (for the budget)
    limits: TextLimits | None = None

    def choices(self, n: int) -> list[Plan]:
        """`n` plans for n choices of one prompt (the engine batches them), the first being this one. With a
        seed, choice i samples with seed + i, so choices differ under sampling and each is reproducible."""
        out = [self]
        req = self.request
        for i in range(1, n):
            seed = req.params.seed
            params = replace(req.params, seed=None if seed is None else (seed + i) & 0xFFFFFFFF,
                             logit_bias=list(req.params.logit_bias))
            out.append(dataclasses.replace(self, request=replace(req, params=params, stop=list(req.stop),
                                                                 id=f"{req.id}-{i}"),
                                           notices=list(self.notices),
                                           limits=dataclasses.replace(self.limits) if self.limits else None))
        return out
