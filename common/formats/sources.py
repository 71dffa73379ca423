"""Data read through Hugging Face datasets (a feature: loaded for an input that is not a small parquet file).

JSON / JSONL, CSV and Arrow files, save_to_disk folders and dataset names (ORG/NAME[:SUBSET][@SPLIT], from the
Hugging Face cache, or the Hub where it is reachable) become the same plain rows as a parquet file's (read_source),
or a memory-mapped Dataset (open_source: a large parquet file too, for common.formats.prompt_cache). datasets
turns a file into its Arrow cache once (~/.cache/huggingface/datasets, found again by the file's fingerprint) and
memory-maps it; a folder is memory-mapped as saved. A flat format's dotted column (CSV: reward_model.ground_truth)
is nested as verl's structs are. Every error names the input and says what to give instead."""

import contextlib
import json
import re
from pathlib import Path

from common.errors import DataError

# A file's suffix -> the datasets builder that reads it.
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow", ".parquet": "parquet"}
KINDS = "a parquet, JSON / JSONL, CSV or Arrow file, or a folder written by datasets' save_to_disk"
# A dataset's name: ORG/NAME, then :SUBSET (its configuration) and @SPLIT, each optional.
NAME = re.compile(r"^(?P<name>[\w.-]+/[\w.-]+)(?::(?P<subset>[\w.-]+))?(?:@(?P<split>[\w.-]+))?$")


def read_source(spec: str, what: str) -> list[dict]:
    """The rows of one input of `what` (--train-files, say) as plain dicts (open_source's, read whole)."""
    data = open_source(spec, what)
    rows = data.to_list()
    return [nested(row) for row in rows] if dotted(data) else rows


def open_source(spec: str, what: str):
    """One input of `what` as a memory-mapped datasets.Dataset: a file by its suffix (BUILDERS), a save_to_disk
    folder (FOLDER@SPLIT choosing one split of a folder that holds several, a DatasetDict), a dataset's name, or a
    reasoning-gym task (reasoning-gym:NAME?size=...&seed=..., common.formats.reasoning_gym)."""
    if spec.startswith("reasoning-gym:"):
        import datasets

        from common.formats.reasoning_gym import read

        return datasets.Dataset.from_list(read(spec, what))
    path, split = Path(spec).expanduser(), None
    if not path.exists() and "@" in path.name:
        base, split = spec.rsplit("@", 1)
        path = Path(base).expanduser()
    named = None if path.exists() or path.suffix.lower() in (*BUILDERS, ".parquet") else NAME.match(spec)
    if not path.exists() and named is None:
        raise DataError(f"{what}: file {spec!r} does not exist (give {KINDS}, or a dataset's name: ORG/NAME)")
    import datasets

    datasets.disable_progress_bars()  # one line per input is said by the caller, not a bar per split
    if named is not None:
        data = _named(datasets, spec, what, **named.groupdict())
    elif path.is_dir():
        data = _folder(datasets, path, spec, split, what)
    else:
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"{what}: {spec!r} is not a data file this library reads (suffix {path.suffix!r}); give {KINDS}"
            )
        if split is not None:
            raise DataError(f"{what}: {spec!r}: @{split} picks a split of a save_to_disk folder; a file is one split")
        try:
            data = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:  # datasets raises several types for a malformed file, naming its chunk's row
            why = _why_malformed(path, builder) or _first_line(e)
            raise DataError(f"{what}: {spec!r} is not a readable {builder.upper()} file ({why})") from e
    return data


def _why_malformed(path: Path, builder: str) -> str | None:
    """Plainer than datasets' words for the usual malformed JSON Lines or CSV file: the line to fix, in the file's
    own numbering (datasets counts rows of the chunk it was parsing), or that the file is empty."""
    if builder == "csv" and not path.read_text(errors="replace").strip():
        return "it is empty: a CSV file needs a header line and a line a row"
    if builder != "json" or path.suffix.lower() != ".jsonl":
        return None
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line) if line.strip() else {}
            except ValueError as e:
                return f"line {number} is not valid JSON: {e}"
            if not isinstance(row, dict):
                return f"line {number} is a JSON {type(row).__name__}, not an object: JSON Lines hold one row, an object, a line"
    return None


def dotted(data) -> bool:
    return any("." in column for column in data.column_names)


def _folder(datasets, path: Path, spec: str, split: str | None, what: str):
    """The one split of a save_to_disk folder: a Dataset's, or the DatasetDict's split `split` names."""
    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(
            f"{what}: {spec!r} is a folder that datasets' save_to_disk did not write ({_first_line(e)}); give {KINDS}"
        ) from e
    if not isinstance(data, datasets.DatasetDict):
        if split is not None:
            raise DataError(f"{what}: {spec!r}: the folder holds one split, not {split!r}; drop @{split}")
        return data
    if split is None and len(data) == 1:
        return next(iter(data.values()))
    if split not in data:
        name = str(path) if split is None else spec.rsplit("@", 1)[0]
        asked = "" if split is None else f" has no split {split!r}:"
        raise DataError(
            f"{what}: {spec!r}{asked} it holds the splits {', '.join(data)}; name one as {name}@{next(iter(data))}"
        )
    return data[split]


def _named(datasets, spec: str, what: str, name: str, subset: str | None, split: str | None):
    """A dataset by its name: the split asked for (default: test for validation, else train) of its subset."""
    split = split or ("test" if what.startswith("val") else "train")
    offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable()
    try:
        with _offline(datasets, offline):  # the cache alone, at once: datasets would retry the Hub for 30 s
            return datasets.load_dataset(name, subset, split=split)
    except ConnectionError as e:  # offline (HF_HUB_OFFLINE) and not in the cache, or the Hub out of reach
        raise DataError(
            f"{what}: {spec!r} is neither a file nor a dataset in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}), and the Hub is out of reach ({_first_line(e)}); give {KINDS}, or the name "
            f"of a dataset loaded once with datasets (HF_HUB_OFFLINE=1 reads the cache without trying the Hub)"
        ) from e
    except (ValueError, FileNotFoundError) as e:  # an unknown split or subset; a cache without the files
        raise DataError(
            f"{what}: {spec!r}: {_first_line(e)} (the split follows @, the subset :, as in {name}:main@{split})"
        ) from e


def _hub_reachable(seconds: float = 3.0) -> bool:
    """Whether a connection to the Hugging Face Hub's host opens within `seconds`."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=seconds).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline(datasets, offline: bool):
    """datasets and huggingface_hub reading only the local cache inside the block (their flags, as HF_HUB_OFFLINE=1
    sets them at import), when `offline`."""
    import huggingface_hub

    flags = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    flags.append((huggingface_hub.constants, "HF_HUB_OFFLINE"))
    saved = [getattr(module, name) for module, name in flags]
    try:
        if offline:
            for module, name in flags:
                setattr(module, name, True)
        yield
    finally:
        for (module, name), value in zip(flags, saved):
            setattr(module, name, value)


def nested(row: dict) -> dict:
    """reward_model.ground_truth = x -> reward_model: {ground_truth: x}, as verl's parquet holds it."""
    out = {}
    for key, value in row.items():
        *parents, leaf = key.split(".")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
