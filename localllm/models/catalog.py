"""The model catalog: `name:tag` -> where the GGUF comes from and how to run it.

The shipped `models.toml` (inside the wheel; beside the package in a source checkout) is merged with
the user's `models.toml` in the config folder, entry by entry. Besides catalog names, `resolve`
accepts `hf.co/<owner>/<repo>[:QUANT]` and a path to a local `.gguf` file (an import). A vision
model's entry names its projector: `mmproj = "<file>.gguf"` in its `repo` (or in `mmproj_repo`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm import config
from localllm.errors import InvalidInput, InvalidModelName, ModelNotFound
from localllm.models.names import DEFAULT_TAG, HF_PREFIXES, parse_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KNOWN_QUANTS = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S",
    "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_M", "IQ3_XXS",
    "IQ2_M", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
)


@dataclass(frozen=True)
class Source:
    """Where one model comes from, resolved from a name the user typed."""

    kind: str  # "hf" | "pypi" | "file"
    name: str  # store name, "name:tag"
    quant: str | None = None
    repo: str | None = None
    filename: str | None = None  # None for hf.co refs: found by listing the repo
    pypi: str | None = None
    module: str | None = None
    path: Path | None = None
    entry: dict[str, Any] = field(default_factory=dict)
    # quantize on pull: "no"; "yes" = `quant` is not published, fetch the F16/BF16/F32 original
    # (`repo` + `filename`, or found by listing `repo` when `filename` is None) and quantize it
    # locally; "if-missing" = hf.co refs with an explicit quant: do that only when the repo lacks it
    local_quant: str = "no"
    # the vision projector (mmproj GGUF) installed beside the model: `mmproj`, a file in `mmproj_repo` on the
    # hub (a catalog entry's `mmproj`); `mmproj_path`, a local file (`pull … --mmproj PROJ.gguf`);
    # `find_mmproj`: hf.co refs take the repo's own (llama-server's -hf rule, hub.pick_projector);
    # `no_mmproj` (`pull --no-mmproj`): none, and a projector the name had is detached
    mmproj: str | None = None
    mmproj_repo: str | None = None
    mmproj_path: Path | None = None
    find_mmproj: bool = False
    no_mmproj: bool = False

    @property
    def wants_projector(self) -> bool:
        return bool(self.mmproj or self.mmproj_path or self.find_mmproj or self.no_mmproj)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path} is not valid TOML: {exc}", "fix the file or remove it") from exc


def shipped_catalog_path() -> Path:
    package = Path(__file__).resolve().parent.parent  # localllm/
    inside = package / "models.toml"  # in an installed wheel
    return inside if inside.is_file() else package.parent / "models.toml"  # in a source checkout


class Catalog:
    def __init__(self, data: dict[str, Any]) -> None:
        self.defaults: dict[str, Any] = data.get("defaults", {})
        self.aliases: dict[str, str] = data.get("aliases", {})
        self.models: dict[str, dict[str, Any]] = data.get("models", {})

    @classmethod
    def load(cls, extra: Path | None = None) -> Catalog:
        data = _read_toml(shipped_catalog_path())
        user = extra if extra is not None else config.paths().user_catalog
        if user.is_file():
            override = _read_toml(user)
            for table in ("defaults", "aliases"):
                data.setdefault(table, {}).update(override.get(table, {}))
            for key, entry in override.get("models", {}).items():
                data.setdefault("models", {}).setdefault(key, {}).update(entry)
        return cls(data)

    def entry(self, name: str) -> dict[str, Any] | None:
        """The catalog entry for `name:tag` with defaults filled in, following aliases."""
        key = self.aliases.get(name, name)
        entry = self.models.get(key)
        if entry is None:
            return None
        return {**self.defaults, **entry, "key": key}

    def names(self) -> list[str]:
        return sorted(self.models)

    def suggest(self, name: str, n: int = 3) -> list[str]:
        pool = self.names() + list(self.aliases)
        close = difflib.get_close_matches(name, pool, n=n, cutoff=0.4)
        base = name.split(":")[0]
        close += [k for k in self.names() if k.split(":")[0] == base and k not in close]
        return close[: max(n, 3)]

    def resolve(self, text: str, quant: str | None = None) -> Source:
        """Turn what the user typed into a Source; raises with suggestions when unknown."""
        raw = text.strip() if isinstance(text, str) else text
        if isinstance(raw, str) and raw.lower().endswith(".gguf") and not raw.lower().startswith(HF_PREFIXES):
            path = Path(raw).expanduser()
            if not path.is_file():
                raise ModelNotFound(f"no such file: {raw}", "give the path of an existing .gguf file")
            stem = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._") or "imported"
            return Source(kind="file", name=f"{stem}:{DEFAULT_TAG}", path=path.resolve())
        name, tag = parse_name(raw)
        lowered = name.lower()
        for prefix in HF_PREFIXES:
            if lowered.startswith(prefix):
                repo = name[len(prefix):]
                if repo.count("/") != 1:
                    raise InvalidModelName(f"{text!r} is not hf.co/<owner>/<repo>[:QUANT]")
                explicit = quant or (tag if tag != DEFAULT_TAG else None)
                q = (explicit or self.defaults.get("default_quant", "Q4_K_M")).upper()
                local = "if-missing" if explicit and q in _local_types() else "no"
                return Source(kind="hf", name=f"hf.co/{repo}:{q}", quant=q, repo=repo, local_quant=local,
                              find_mmproj=True)
        key = f"{lowered}:{tag}"
        entry = self.entry(key)
        if entry is None:
            hints = self.suggest(key)
            hint = f"did you mean: {', '.join(hints)}?" if hints else "run `localllm list --catalog`"
            raise ModelNotFound(f"model {key!r} is not in the catalog", hint)
        q = (quant or entry.get("default_quant", "Q4_K_M")).upper()
        quants = [s.upper() for s in entry.get("quants", [])]
        store_name = entry["key"] if q == entry.get("default_quant", "Q4_K_M").upper() else f"{entry['key']}-{q.lower()}"
        if quants and q not in quants:
            return _with_projector(self._local_quant(entry, q, quants, store_name), entry)
        if "pypi" in entry:
            return _with_projector(Source(kind="pypi", name=store_name, quant=q, pypi=entry["pypi"],
                                          module=entry.get("module"), entry=entry), entry)
        if "repo" not in entry or "file" not in entry:
            raise InvalidInput(f"catalog entry {entry['key']} has neither `repo`+`file` nor `pypi`")
        return _with_projector(Source(kind="hf", name=store_name, quant=q, repo=entry["repo"],
                                      filename=entry["file"].format(quant=q), entry=entry), entry)

    def _local_quant(self, entry: dict[str, Any], q: str, published: list[str], store_name: str) -> Source:
        """`q` is not published for `entry`: a Source that fetches the unquantized original to quantize."""
        key, local = entry["key"], _local_types()
        made = f"made locally from the F16/BF16 original: {', '.join(local)}"
        if q not in local:
            if q not in KNOWN_QUANTS:
                raise InvalidInput(f"unknown quantization type {q!r}",
                                   f"published for {key}: {', '.join(published)}; {made}")
            raise InvalidInput(f"{key} has no {q} file, and localllm cannot make {q} itself",
                               f"published: {', '.join(published)}; {made}")
        # where the original is: `unquantized_repo`/`unquantized_file`, else the entry's repo, where a
        # published F16/BF16 comes first, else the repo is listed at pull time
        repo = entry.get("unquantized_repo") or entry.get("repo")
        filename = entry.get("unquantized_file")
        if not filename and "repo" in entry and "file" in entry and not entry.get("unquantized_repo"):
            for original in ("F16", "BF16", "F32"):
                if original in published:
                    filename = entry["file"].format(quant=original)
                    break
        if not repo:
            raise InvalidInput(f"{key} is published only as {', '.join(published)}, and no F16/BF16 source is "
                                f"known for it, so {q} cannot be made locally",
                                f"pull {published[0] if published else 'the published quant'} instead, or add "
                                f"`unquantized_repo`/`unquantized_file` for {key} in your models.toml")
        return Source(kind="hf", name=store_name, quant=q, repo=repo, filename=filename, entry=entry,
                      local_quant="yes")


def _with_projector(source: Source, entry: dict[str, Any]) -> Source:
    """The entry's `mmproj` (a file in `mmproj_repo`, else in the entry's `repo`) on its Source."""
    mmproj = entry.get("mmproj")
    if not mmproj:
        return source
    repo = entry.get("mmproj_repo") or entry.get("repo")
    if not isinstance(mmproj, str) or not mmproj.lower().endswith(".gguf") or not repo:
        raise InvalidInput(f"catalog entry {entry['key']}: `mmproj` must name a .gguf file in `repo` "
                           "(or in `mmproj_repo`)")
    return dataclasses.replace(source, mmproj=mmproj, mmproj_repo=repo)


def _local_types() -> tuple[str, ...]:
    from localllm.models.quantize import (
        LOCAL_TYPES,  # the table lives with the quantizer (no llama_cpp import)
    )

    return LOCAL_TYPES
