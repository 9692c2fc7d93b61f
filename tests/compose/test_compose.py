"""The one request builder (compose/requests.py) and the composition module, on the tiny real model:
the policies every door now shares, and the divergences they replaced."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from tinymodel import BOS, EOS, make_tiny_gguf

from localllm.compose.formats import ChatFormat, builtin_format, file_format, raw_format
from localllm.compose.pipeline import Reply
from localllm.compose.requests import MAX_TOKENS_PER_CTX, Options, RequestBuilder, max_tokens_for
from localllm.compose.templates import render_chat_parts
from localllm.errors import ContextOverflow, InvalidInput
from localllm.runtime.engine.scheduler import Engine
from localllm.tui.backend import ChatSettings, EngineBackend

TURNS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"},
         {"role": "assistant", "content": "foo bar"}, {"role": "user", "content": "json stop"}]
# a Mistral-style template: BOS written by the template, EOS after every assistant turn
MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% else %}{{ m['content'] }}\n"
                "{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_gguf(tmp_path_factory.mktemp("compose") / "tiny.gguf")
    with Engine(path, n_ctx=256, slots=1, threads=2) as eng:
        yield eng


def test_max_tokens_policy_is_one_rule() -> None:
    assert max_tokens_for(None, 1024) == max_tokens_for(-1, 1024) == max_tokens_for(-2, 1024) == 1024
    assert max_tokens_for(10**9, 1024) == MAX_TOKENS_PER_CTX * 1024
    assert max_tokens_for(7, 1024) == 7
    with pytest.raises(InvalidInput, match="options.num_predict must be a positive integer"):
        max_tokens_for(0, 1024, "options.num_predict")


def test_chat_ui_in_process_no_limit_ends_like_over_http(engine: Any) -> None:
    """The chat UI passed max_tokens=None with the shift policy and generated without end (the tiny model
    never samples EOS); over HTTP the same setting became num_predict -1 → n_ctx. Now both are n_ctx."""
    backend = EngineBackend.single(engine, "tiny")
    settings = ChatSettings(max_tokens=None, context_policy="shift", temperature=0.0)
    _, plan = backend.request("tiny", [{"role": "user", "content": "hello"}], settings)
    req = plan.request
    assert req.max_tokens == engine.n_ctx
    chunks: list[Any] = []
    t = threading.Thread(target=lambda: chunks.extend(backend.stream("tiny", [{"role": "user", "content": "hello"}],
                                                                     settings)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "an unlimited chat-UI generation must end by itself"
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == engine.n_ctx


def test_n_keep_is_the_system_prefix_as_it_appears_in_the_prompt(engine: Any) -> None:
    fmt = builtin_format("chatml", engine.model)
    req = RequestBuilder(fmt, engine).chat(TURNS, Options()).request
    parts = render_chat_parts(fmt.template, TURNS, bos_token=fmt.bos_token, eos_token=fmt.eos_token)
    system = engine.tokenize(parts.system_prefix)
    assert req.prompt == engine.tokenize(parts.text) and req.prompt[0] == BOS and req.prompt.count(BOS) == 1
    assert 1 < req.n_keep <= len(system) and req.prompt[:req.n_keep] == system[:req.n_keep]
    assert req.context_policy == "shift"
    assert RequestBuilder(fmt, engine).chat(TURNS, Options(n_keep=-1)).request.n_keep == -1  # the client's word wins


def test_a_chats_next_turn_tokenizes_its_system_prefix_once(engine: Any) -> None:
    """n_keep needs the system prefix's tokens; a chat's next turns have the same prefix, and a runner's tokenizer is
    a round trip away (~0.7 ms a request). Each later turn now tokenizes its prompt only, with the same n_keep as a
    format that never saw the chat; another system prompt is tokenized again."""

    class Counting:
        def __init__(self) -> None:
            self.model, self.n_ctx, self.texts = engine.model, engine.n_ctx, []

        def tokenize(self, text: str, **kw: Any) -> list[int]:
            self.texts.append(text)
            return engine.tokenize(text, **kw)

    fmt, counting = builtin_format("chatml", engine.model), Counting()
    first = RequestBuilder(fmt, counting).chat(TURNS[:2], Options()).request
    assert len(counting.texts) == 2  # the prompt, the system prefix
    later = TURNS + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "again"}]
    for msgs in (TURNS, later):
        counting.texts.clear()
        req = RequestBuilder(fmt, counting).chat(msgs, Options()).request
        assert len(counting.texts) == 1
        fresh = RequestBuilder(builtin_format("chatml", engine.model), engine).chat(msgs, Options()).request
        assert req.n_keep == fresh.n_keep == first.n_keep > 1 and req.prompt == fresh.prompt
    counting.texts.clear()
    other = [{"role": "system", "content": "You are verbose."}, *TURNS[1:]]
    assert RequestBuilder(fmt, counting).chat(other, Options()).request.n_keep > 1 and len(counting.texts) == 2


def test_template_bos_and_eos_are_the_models_own(engine: Any) -> None:
    """Templates were rendered with bos_token="" and eos_token="": a Mistral-style template lost the EOS
    that closes each assistant turn. Now both are the model's tokens, and BOS still comes once."""
    fmt = ChatFormat(MISTRAL_LIKE, "gguf", bos_token=builtin_format("plain", engine.model).bos_token,
                     eos_token=builtin_format("plain", engine.model).eos_token)
    prompt = RequestBuilder(fmt, engine).chat(TURNS, Options()).request.prompt
    assert prompt[0] == BOS and prompt.count(BOS) == 1
    assert prompt.count(EOS) == 1  # after the one assistant turn


def test_options_are_checked_once_with_the_doors_names(engine: Any) -> None:
    build = RequestBuilder(raw_format(), engine)
    with pytest.raises(InvalidInput, match="options.num_keep must be an integer >= -1"):
        build.prompt("hello", Options(n_keep=-5, n_keep_name="options.num_keep"))
    with pytest.raises(InvalidInput, match="temperature must be >= 0"):
        build.prompt("hello", Options(sampling={"temperature": -1}))
    with pytest.raises(InvalidInput, match="context_policy must be one of"):
        build.prompt("hello", Options(context_policy="forget"))
    req = build.prompt("hello", Options(stop="world", format="json", draft={"speculative.n_max": 4})).request
    assert req.stop == ["world"] and req.json_schema == {"type": "object"} and req.draft_max == 4
    assert req.context_policy == "error" and req.n_keep == 0  # a bare prompt: the completion doors' default


def test_raw_prompt_and_templated_prompt(engine: Any, tmp_path: Path) -> None:
    """`run --raw` sends the text as typed; without --raw a file with no template gets the plain fallback,
    whose stop strings come along."""
    raw = RequestBuilder(raw_format(), engine).prompt("hello world", Options(), template=False).request
    assert raw.prompt == engine.tokenize("hello world") and raw.stop == []
    path = make_tiny_gguf(tmp_path / "t.gguf", chat_template="{% for m in messages %}<<{{ m['content'] }}>>"
                                                             "{% endfor %}")
    fmt = file_format(path, None, engine.model)
    assert fmt.template_name == "gguf"
    req = RequestBuilder(fmt, engine).prompt("hello", Options(), system="be brief", template=True).request
    assert req.prompt == engine.tokenize("<<be brief>><<hello>>") and req.n_keep > 1


def test_infill_uses_the_models_fim_tokens(engine: Any) -> None:
    fmt = ChatFormat(None, "none", fim={"prefix": "<pre>", "suffix": "<suf>", "middle": "<mid>"})
    req = RequestBuilder(fmt, engine).infill("def f(", "):", Options(max_tokens=8)).request
    assert req.prompt == engine.tokenize("<pre>def f(<suf>):<mid>") and req.max_tokens == 8


def test_an_empty_prompt_is_refused(engine: Any) -> None:
    """Tokenizing "" gives [BOS]: the engine's emptiness check never saw it, and `/v1/completions` with
    `"prompt": ""` generated from BOS alone (found in review). The builder refuses it, as before."""
    with pytest.raises(InvalidInput, match="prompt is empty"):
        RequestBuilder(raw_format(), engine).prompt("", Options())
    with pytest.raises(InvalidInput, match="prompt is empty"):
        RequestBuilder(builtin_format("plain", engine.model), engine).prompt("", Options(), template=True)


def test_one_turn_prompt_under_truncate_history_shifts(engine: Any) -> None:
    """Ollama /api/generate through the template is one user turn: nothing for truncate_history to drop,
    so an overflowing prompt falls back to a shift (200 with a notice) instead of a ContextOverflow."""
    long = " ".join(["hello world"] * 400)  # ~800 tokens on a 256-token context
    plan = RequestBuilder(builtin_format("plain", engine.model), engine).prompt(
        long, Options(max_tokens=4, context_policy="truncate_history"), template=True, policy="shift")
    assert not plan.notices and plan.request.context_policy == "shift"
    res = engine.submit(plan.request).result()
    assert res.usage.completion_tokens == 4 and res.notices and res.notices[0].n_dropped > 0


def test_a_final_assistant_message_is_continued_not_answered(engine: Any) -> None:
    """Assistant prefill, as llama-server and Ollama do it: the model continues the last assistant message
    (the turns before it get the assistant's generation prompt, then its text follows)."""
    fmt = builtin_format("chatml", engine.model)
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "json foo"}]
    req = RequestBuilder(fmt, engine).chat(turns, Options()).request
    assert req.prompt == engine.tokenize("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\njson foo")
    # OpenAI content parts: joined by a blank line, as llama.cpp's common_chat_msg::render_content continues them
    parts = [{"type": "text", "text": "json"}, {"type": "text", "text": "foo"}]
    assert RequestBuilder(fmt, engine).chat([turns[0], {"role": "assistant", "content": parts}], Options()).request.prompt \
        == engine.tokenize("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\njson\n\nfoo")
    with pytest.raises(InvalidInput, match="Cannot have 2 or more assistant messages at the end of the list"):
        RequestBuilder(fmt, engine).chat([*turns, {"role": "assistant", "content": "bar"}], Options())


def test_a_stream_knows_its_slot(tmp_path: Path) -> None:
    """llama-server's `id_slot` comes from the engine's own admission, not from a guess afterwards."""
    with Engine(make_tiny_gguf(tmp_path / "t.gguf"), n_ctx=512, slots=2, threads=2) as eng:
        build = RequestBuilder(raw_format(), eng)
        # neither may end before both are admitted: no EOS (sampled, it can come at once), and the iterators
        # are kept (a dropped one cancels its stream)
        a = eng.submit(build.prompt("hello world", Options(max_tokens=400, ignore_eos=True)).request)
        b = eng.submit(build.prompt("foo bar json", Options(max_tokens=400, ignore_eos=True)).request)
        ia, ib = iter(a), iter(b)
        next(ia), next(ib)
        assert {a.slot, b.slot} == {0, 1}  # two requests at once: one slot each
        a.cancel(), b.cancel()


def test_truncate_history_drops_the_oldest_turns_in_the_builder(engine: Any) -> None:
    """truncate_history is the builder's: a chat that leaves too little room to answer is rendered again
    without its oldest turns (the system prompt and the last turn stay), the plan says so first, and the
    engine gets a prompt that fits with the shift policy; a chat that cannot fit is refused, not cut."""
    fmt = builtin_format("chatml", engine.model)
    turns = [TURNS[0]] + [{"role": r, "content": "hello world " * 12} for r in ("user", "assistant") * 4] \
        + [{"role": "user", "content": "json stop"}]
    build = RequestBuilder(fmt, engine)
    whole = len(build.chat(turns, Options(max_tokens=10)).request.prompt)
    assert whole > engine.n_ctx - 10  # past what leaves room to answer
    plan = build.chat(turns, Options(max_tokens=10, context_policy="truncate_history"))
    req = plan.request
    assert [n.kind for n in plan.notices] == ["history_truncated"] and plan.notices[0].n_dropped == whole - len(req.prompt)
    assert len(req.prompt) <= engine.n_ctx - 10 and req.context_policy == "shift"
    text = engine.detokenize(req.prompt)
    assert "You are terse." in text and text.rstrip().endswith("json stop<|im_end|>\n<|im_start|>assistant")
    res = Reply(engine, plan).result()
    assert res.notices[0].kind == "history_truncated" and res.usage.prompt_tokens == len(req.prompt)
    huge = [TURNS[0], {"role": "user", "content": "hello world " * 200}]
    with pytest.raises(ContextOverflow):  # nothing old enough to drop, and it does not fit: refused, not cut
        build.chat(huge, Options(max_tokens=10, context_policy="truncate_history"))
