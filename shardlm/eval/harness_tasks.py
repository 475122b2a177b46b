"""The harness tasks shardlm ships (`shardlm/eval/tasks/*.yaml`) and the functions their YAMLs name.

The YAMLs read local files only (`dataset_path: json` or `text` with `dataset_kwargs.data_files`),
so nothing is downloaded. Their relative data paths are relative to the shared data folder;
`render_tasks` writes copies with those paths made absolute, which `shardlm eval harness` gives the
harness as an include path. This module imports neither lm_eval nor torch: the harness imports the
functions below by their dotted names (`!function shardlm.eval.harness_tasks.rolling_results`), so a
copied YAML works from any folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardlm.eval.detokenize import wikitext_detokenize

TASKS_DIR = Path(__file__).with_name("tasks")


def wikitext_document(doc: dict) -> str:
    """The text the harness scores: a WikiText document (`{"text": raw tokens}`), detokenized."""
    return wikitext_detokenize(doc["text"])


def rolling_results(doc: dict, results: list[float]) -> dict:
    """Word and byte counts of the document as written, beside its log-likelihood, for the harness's
    weighted word/byte perplexity and bits per byte (as its `wikitext` task counts them)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    size = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}


class _Function(str):
    """A `!function` value, kept as written."""


def _yaml_io():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    class Dumper(yaml.SafeDumper):
        pass

    Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
    Dumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))
    return yaml, Loader, Dumper


def render_tasks(data_dir: str | Path, out_dir: str | Path) -> dict[str, list[Path]]:
    """Write each shipped task YAML into `out_dir` with its relative data_files resolved against
    `data_dir`; returns {task name: the data files it reads}."""
    yaml, loader, dumper = _yaml_io()
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = {}
    for source in sorted(TASKS_DIR.glob("*.yaml")):
        config = yaml.load(source.read_text(encoding="utf-8"), Loader=loader)
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        for split, path in files.items():
            files[split] = str(data_dir / path) if not Path(path).is_absolute() else path
        (out_dir / source.name).write_text(yaml.dump(config, Dumper=dumper, sort_keys=False), encoding="utf-8")
        tasks[config["task"]] = [Path(p) for p in files.values()]
    return tasks
