"""Images through the engine: gemma-3-270m (a real text model) with a tiny generated Gemma 3 projector
(tests/visionmodel.py), on llama.cpp's multimodal library. The references are fresh single-sequence engines."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from visionmodel import write_gemma3_mmproj

from localllm.compose import media
from localllm.errors import ContextOverflow, InvalidInput, ModelLoadError
from localllm.eval.reference import TOL
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.runner.host import Runner
from localllm.runtime.types import MEDIA_MARKER, GenerationParams, Image, Request

GREEDY = GenerationParams(temperature=0)
KERNELS = "none"  # as llama-server --no-repack: the differential bench's setting
TEXT = f"<start_of_turn>user\nDescribe:{MEDIA_MARKER}<end_of_turn>\n<start_of_turn>model\n"
N_IMAGE = (32 // 4 // 2) ** 2  # the projector's image_size / patch / merge, squared


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_mmproj(tmp_path_factory.mktemp("vision") / "mmproj.gguf", n_embd_text=640)


@pytest.fixture(scope="module")
def images() -> list[Image]:
    return [media.decode(png(1), "a.png"), media.decode(png(2), "b.png")]


@dataclass(frozen=True)
class Ref:
    """A fresh one-slot engine's greedy reply, and its 16 best logprobs at each position."""
    tokens: list[int]
    top: list[dict[int, float]]


def assert_like(got: Sequence[int], ref: Ref) -> None:
    """`got` is the reference's reply up to a near-tie (eval/reference.py's rule): where they first part, the
    reference ranks got's token within TOL of its best, and nothing after is compared (both continuations are
    right). For a path that does not run the reference's batches on its cells: the random projector leaves
    margins down to 0.1 logits, which another CPU's kernels may flip."""
    for j, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            top = ref.top[j]
            assert a in top and top[a] >= max(top.values()) - TOL, (j, a, b, top)
            return
    assert len(got) == len(ref.tokens), (list(got), ref.tokens)


@pytest.fixture(scope="module")
def references(gemma_file: Path, mmproj: Path, images: list[Image]) -> list[Ref]:
    """Each image's greedy reply on a fresh one-slot engine."""
    out = []
    for im in images:
        with Engine(gemma_file, n_ctx=1024, slots=1, threads=2, cpu_kernels=KERNELS, mmproj=mmproj) as e:
            r = e.generate(Request(e.tokenize_media(TEXT, [im]), GREEDY, max_tokens=12, media=[im], n_probs=16))
            out.append(Ref(r.tokens, [{t.id: t.logprob for t in p.top} for p in r.probs]))
    assert out[0].tokens[:2] != out[1].tokens[:2]  # the tests below mean something only if the images lead apart
    return out


@pytest.fixture
def engine(gemma_file: Path, mmproj: Path) -> Iterator[Engine]:
    with Engine(gemma_file, n_ctx=1024, slots=2, threads=2, cpu_kernels=KERNELS, mmproj=mmproj) as e:
        yield e


def test_an_image_is_its_tokens_between_gemmas_markers(engine: Engine, images: list[Image]) -> None:
    toks = engine.tokenize_media(TEXT, [images[0]])
    image = [i for i, t in enumerate(toks) if t < 0]
    assert len(image) == N_IMAGE and image == list(range(image[0], image[0] + N_IMAGE))
    assert toks[image[0]:image[-1] + 1] == images[0].tokens(N_IMAGE)
    assert engine.model.token_text(toks[image[0] - 1]) == b"<start_of_image>"
    assert engine.model.token_text(toks[image[-1] + 1]) == b"<end_of_image>"
    assert MEDIA_MARKER in engine.detokenize(toks)
    assert images[0].tokens(N_IMAGE) != images[1].tokens(N_IMAGE)


def test_prefix_reuse_never_mixes_two_images(engine: Engine, images: list[Image],
                                            references: list[Ref]) -> None:
    """a, b, a, b on one engine, one after another: each reuses the text before the image at most, and
    answers as its fresh reference does (up to near-ties: the reused prefix splits the batches otherwise);
    then both at once, in two slots."""
    for k in (0, 1, 0, 1):
        im = images[k]
        r = engine.generate(Request(engine.tokenize_media(TEXT, [im]), GREEDY, max_tokens=12, media=[im]))
        assert_like(r.tokens, references[k])
        assert r.usage.cached_tokens < len(TEXT)  # never through a different image
    # the same image again reuses everything but the last prompt token
    im = images[1]
    prompt = engine.tokenize_media(TEXT, [im])
    r = engine.generate(Request(prompt, GREEDY, max_tokens=12, media=[im]))
    assert r.usage.cached_tokens == len(prompt) - 1
    assert_like(r.tokens, references[1])
    streams = [engine.submit(Request(engine.tokenize_media(TEXT, [im]), GREEDY, max_tokens=12, media=[im]))
               for im in images]
    results = [s.result() for s in streams]
    for k, res in enumerate(results):
        assert_like(res.tokens, references[k])  # batched beside each other
    assert results[0].tokens[:2] != results[1].tokens[:2]


def test_an_image_cut_from_a_cached_prefix_is_evaluated_whole(engine: Engine, images: list[Image],
                                                             references: list[Ref]) -> None:
    """A slot holding [text, image a, text]: a prompt [text, image a] + other text reuses through the image;
    one that stops inside image a's tokens (a truncated history) never keeps half an image."""
    im = images[0]
    engine.generate(Request(engine.tokenize_media(TEXT, [im]), GREEDY, max_tokens=4, media=[im]))
    other = f"<start_of_turn>user\nDescribe:{MEDIA_MARKER} in one word<end_of_turn>\n<start_of_turn>model\n"
    prompt = engine.tokenize_media(other, [im])
    r = engine.generate(Request(prompt, GREEDY, max_tokens=4, media=[im]))
    start = next(i for i, t in enumerate(prompt) if t < 0)
    assert r.usage.cached_tokens >= start + N_IMAGE  # through the whole image


def test_requests_with_images_are_checked(engine: Engine, images: list[Image], gemma_file: Path) -> None:
    prompt = engine.tokenize_media(TEXT, [images[0]])
    with pytest.raises(InvalidInput, match="do not match"):  # the ids of one image, the pixels of another
        engine.submit(Request(prompt, GREEDY, media=[images[1]]))
    with pytest.raises(InvalidInput, match="images were sent"):
        engine.submit(Request(prompt, GREEDY, media=images))
    with pytest.raises(InvalidInput, match="outside the vocabulary"):  # image ids without the image
        engine.submit(Request(prompt, GREEDY))
    with pytest.raises(InvalidInput, match="ends with an image"):
        engine.submit(Request(engine.tokenize_media(MEDIA_MARKER, [images[0]])[:-1], GREEDY, media=[images[0]]))
    with pytest.raises(InvalidInput, match="markers"):
        engine.tokenize_media(TEXT + MEDIA_MARKER, [images[0]])
    with Engine(gemma_file, n_ctx=256, slots=1, threads=2) as text_only:
        assert not text_only.vision
        with pytest.raises(InvalidInput, match="reads no images"):
            text_only.tokenize_media(TEXT, [images[0]])
        with pytest.raises(InvalidInput, match="reads no images"):
            text_only.submit(Request(prompt, GREEDY, media=[images[0]]))


def test_too_many_images_for_the_context_are_refused(gemma_file: Path, mmproj: Path, images: list[Image]) -> None:
    with Engine(gemma_file, n_ctx=256, slots=1, threads=2, mmproj=mmproj) as e:
        many = images * 8  # 16 images of 18 tokens each (with their markers): over 256
        prompt = e.tokenize_media("Compare:" + MEDIA_MARKER * len(many) + " ok", many)
        for policy in ("error", "shift"):  # an image is never cut to fit
            with pytest.raises(ContextOverflow):
                e.submit(Request(prompt, GREEDY, media=many, context_policy=policy))


def test_a_request_with_images_stops_at_a_full_context_instead_of_shifting(gemma_file: Path, mmproj: Path,
                                                                          images: list[Image]) -> None:
    with Engine(gemma_file, n_ctx=256, slots=1, threads=2, mmproj=mmproj) as e:
        im = images[0]
        r = e.generate(Request(e.tokenize_media(TEXT, [im]), GenerationParams(temperature=0), max_tokens=400,
                               media=[im], context_policy="shift", ignore_eos=True))
        assert r.finish_reason == "length" and len(r.tokens) < 256
        assert [n.kind for n in r.notices] == ["context_full"] and "images" in r.notices[0].message


def test_a_runner_process_reads_images(gemma_file: Path, mmproj: Path, images: list[Image],
                                       references: list[Ref]) -> None:
    with Runner(gemma_file, n_ctx=1024, slots=1, threads=2, cpu_kernels=KERNELS, mmproj=mmproj) as r:
        assert r.vision
        im = images[1]
        res = r.generate(Request(r.tokenize_media(TEXT, [im]), GREEDY, max_tokens=12, media=[im]))
        assert res.tokens == references[1].tokens  # the reference's batches on its cells: equal


def test_a_projector_for_another_width_is_refused(gemma_file: Path, tmp_path: Path) -> None:
    bad = write_gemma3_mmproj(tmp_path / "wide.gguf", n_embd_text=1024)
    with pytest.raises(ModelLoadError, match="projector"):
        Engine(gemma_file, n_ctx=256, slots=1, threads=2, mmproj=bad)


def test_an_image_that_fails_to_encode_fails_its_request_only(engine: Engine, images: list[Image]) -> None:
    """The encoder's failure is not "KV cache full": no other request is stopped to make room."""
    from localllm.errors import EngineError

    assert engine.projector is not None
    real = engine.projector.eval

    def broken(ctx, image, pos, seq, n_batch):  # type: ignore[no-untyped-def]
        if image is images[1]:
            raise EngineError("the projector could not encode the image")
        return real(ctx, image, pos, seq, n_batch)

    engine.projector.eval = broken  # type: ignore[method-assign]
    try:
        text = engine.submit(Request("Once upon a time", GREEDY, max_tokens=24, ignore_eos=True))
        bad = engine.submit(Request(engine.tokenize_media(TEXT, [images[1]]), GREEDY, max_tokens=4,
                                    media=[images[1]]))
        with pytest.raises(EngineError, match="could not encode"):
            bad.result()
        r = text.result()
        assert r.finish_reason == "length" and len(r.tokens) == 24 and not r.notices
    finally:
        del engine.projector.eval
    assert engine.stats()["kv_full"] == 0


def test_fuzz_random_image_traffic_never_serves_one_images_kv_for_another(gemma_file: Path, mmproj: Path) -> None:
    """Seeded random traffic, two requests at a time on two slots: three images, questions before and after
    them, repeats. No request reuses more of the cache than it shares, token for token (an image's ids are its
    own), with any prompt before it; each reply's first token is its fresh reference's, or a near-tie of it
    (batched beside another sequence, gemma-3-270m's logits move by up to TOL: eval/reference.py)."""
    import random

    from localllm.runtime.cache.prefix import common_prefix

    rng = random.Random(31)
    pics = [media.decode(png(10 + i, (32 + 8 * i, 40)), f"p{i}") for i in range(3)]
    texts = [f"<start_of_turn>user\n{MEDIA_MARKER}What is this?<end_of_turn>\n<start_of_turn>model\n",
             f"<start_of_turn>user\nLook:{MEDIA_MARKER}<end_of_turn>\n<start_of_turn>model\n",
             f"<start_of_turn>user\nTwo:{MEDIA_MARKER}{MEDIA_MARKER}<end_of_turn>\n<start_of_turn>model\n"]
    cases = [(t, (i,) if k < 2 else (i, (i + 1) % 3)) for k, t in enumerate(texts) for i in range(3)]
    refs: dict[int, Ref] = {}  # case → the fresh reference's first token and its logprobs (top 16)
    with Engine(gemma_file, n_ctx=1024, slots=1, threads=2, cpu_kernels=KERNELS, mmproj=mmproj) as fresh:
        for n, (text, ids) in enumerate(cases):
            fresh.reset_cache()
            ims = [pics[i] for i in ids]
            r = fresh.generate(Request(fresh.tokenize_media(text, ims), GREEDY, max_tokens=1, media=ims, n_probs=16))
            refs[n] = Ref(r.tokens, [{t.id: t.logprob for t in r.probs[0].top}])
    tied: set[int] = set()  # cases whose reply took a near-tie instead of the reference's best
    asked: set[int] = set()  # cases drawn whose reference leads by more than 0.5 logits
    seen: list[list[int]] = []
    with Engine(gemma_file, n_ctx=1024, slots=2, threads=2, cpu_kernels=KERNELS, mmproj=mmproj,
                state_cache_bytes=64 << 20, min_park_tokens=8) as e:
        for _ in range(8):
            batch = [rng.randrange(len(cases)) for _ in range(2)]
            prompts = []
            for n in batch:
                text, ids = cases[n]
                ims = [pics[i] for i in ids]
                prompts.append((n, e.tokenize_media(text, ims), ims))
            streams = [(n, p, e.submit(Request(p, GREEDY, max_tokens=6, media=ims))) for n, p, ims in prompts]
            for n, p, s in streams:
                r = s.result()
                shared = max((common_prefix(p, q) for q in seen + [p2 for _, p2, _ in streams if p2 is not p]),
                             default=0)
                assert r.usage.cached_tokens <= shared, (n, r.usage.cached_tokens, shared)
                assert_like(r.tokens[:1], refs[n])
                # a case whose reference leads by 0.5 logits or less may flip on any CPU: not counted
                top = sorted(refs[n].top[0].values())
                if top[-2] < top[-1] - 0.5:
                    asked.add(n)
                    if r.tokens[0] != refs[n].tokens[0]:
                        tied.add(n)
            seen += [p for _, p, _ in streams]
        assert e.stats()["hits_slot"] + e.stats()["hits_kv"] + e.stats()["hits_ram"] > 0  # reuse did happen
    # Most cases whose reference leads clearly answer with its own first token. Counted per case, not per reply,
    # and not where the reference's two best are close: this seed draws case 2 five times, its two best 0.03 logits
    # apart, and one CPU's flip of that near-tie counted five (CI once failed on a per-reply bound of 4 with 5 ties).
    assert asked and len(tied) * 2 <= len(asked), (sorted(tied), sorted(asked))
