"""Preference optimization from the command line: `shardlm train` with `[preference]` starting from a Hugging Face
chat model's directory, the reference precomputed and saved with the run, the rewards in the log and the plot;
a run stopped by SIGTERM after step 2 and restarted reads its saved reference and equals the uninterrupted run
bitwise (steps, validation loss, final model); a restart with another pair count (records, held-out share) is
refused in one line, and so is one with the same pairs in another order (the tables carry their pairs'
fingerprint) or another LD-DPO weight; the export
(`convert --to-hf`, and a LoRA run's `--to-peft --merge`) gives the run's own logits;
`configs/dpo-tiny-qwen3.toml` with `scripts/dolly_pairs.py`; bad records and settings as one-line errors that
leave nothing behind."""

from __future__ import annotations

import contextlib
import io
import json
import math
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from llama_reference import tiny_qwen3_chat

from shardlm.checkpoint import load_model
from shardlm.cli import main
from shardlm.config import load_config
from shardlm.parallel import ParallelContext
from shardlm.signals import TERMINATED_EXIT_CODE
from shardlm.training.run import StopSignals, train

from agreement import rel

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[model]
seq_length = 512

[sft]
data = ["{records}"]
valid_fraction = 0.1

[preference]
loss = "sigmoid"
beta = 0.1

[train]
precision = "fp32"
micro_batch_size = 2
global_batch_size = 4
steps = 3
lr = 2e-2
warmup_steps = 1
eval_interval = 0
eval_iters = 4

[log]
interval = 1
progress = false
tensorboard = false
"""


def chat_model_and_pairs(root: Path, data_dir: Path, config: str) -> dict:
    """A tiny chat model's HF directory (`hf`), the 20 pairs `scripts/dolly_pairs.py` writes from the first 21 Dolly
    records (`records`) and `config` (a TOML template of {records}) written as the run's config file (`config`)."""
    tiny_qwen3_chat(root / "hf", data_dir, max_positions=512)
    source = root / "dolly.jsonl"
    source.write_text("\n".join((data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:21]) + "\n")
    records = root / "pairs.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "dolly_pairs.py"), str(source), str(records)],
                          capture_output=True, text=True, check=True)
    assert "20 pairs" in done.stdout
    path = root / "run.toml"
    path.write_text(config.format(records=records))
    return {"root": root, "hf": root / "hf", "config": path, "records": records}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    # 21 records: 20 pairs, 2 held out (each start's reference pass covers them all: fewer pairs, less of it)
    return chat_model_and_pairs(tmp_path_factory.mktemp("preference_cli"), data_dir, CONFIG)


def steps_of(run_dir: Path) -> list[dict]:
    """The run's logged training steps and its final validation line, in order (a resumed run appends)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"reward_margin"' in line or '"val_loss"' in line]


def run_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids)


IDS = torch.randint(0, 151936, (2, 16), generator=torch.Generator().manual_seed(0))


def straight_and_resumed(setup, name: str, *extra: str) -> dict:
    """`straight`: 3 steps in one go. `stopped`: the same command stopped by SIGTERM after step 2 (it saves, as a
    preempted job does), then run again: it resumes from step 2. The second start goes through `train` to keep its
    trainer: the run's own model. Each start's printed lines are kept. `extra`: further overrides of both."""
    root, printed = setup["root"], {}
    base = ["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", *extra]
    straight, stopped = root / f"{name}_straight", root / f"{name}_stopped"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(base + ["--run-dir", str(straight)]) == 0
    printed["straight"] = out.getvalue()
    checks = iter([False, False, True])  # the check before each step: SIGTERM arrives during step 2

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out, \
            contextlib.redirect_stderr(out):  # the stop's line goes to stderr
        patch.setattr(StopSignals, "agree_to_stop", lambda self, ctx: next(checks))
        with pytest.raises(SystemExit) as stop:
            main(base + ["--run-dir", str(stopped)])
    assert stop.value.code == TERMINATED_EXIT_CODE
    printed["stopped"] = out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = train(load_config(str(setup["config"]), base[2:]), run_dir=stopped)
    printed["resumed"] = out.getvalue()
    return {"straight": straight, "stopped": stopped, "printed": printed, "trainer": result.trainer}


@pytest.fixture(scope="module")
def dpo_runs(setup):
    """A DPO run straight and stopped after step 2, then resumed: it reads the reference its first start saved (the
    checkpoint no longer holds the starting weights)."""
    return straight_and_resumed(setup, "dpo")


def test_dpo_from_a_hf_directory_saves_its_reference_and_learns(dpo_runs):
    out, run_dir = dpo_runs["printed"]["straight"], dpo_runs["straight"]
    assert ("preference: sigmoid loss, beta 0.1, reference: precomputed by the starting weights for 18 train and 2 "
            "valid pairs") in out, out
    assert "reward margin" in out and (run_dir / "reference_logps.safetensors").is_file()
    steps = [m for m in steps_of(run_dir) if "reward_margin" in m]
    assert len(steps) == 3 and abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[-1]["reward_margin"] > 0
    assert (run_dir / "loss_curve.png").is_file()


def test_a_resumed_dpo_run_reads_its_saved_reference_and_equals_the_straight_run(dpo_runs):
    """Stopped after step 2 and resumed: the resumed start reads the saved reference (recomputing it from the
    step-2 weights would move step 3's loss and rewards off the straight run's), and its step 3 and final
    validation loss equal the straight run's bitwise, as does the final model's output."""
    printed, stopped = dpo_runs["printed"], dpo_runs["stopped"]
    assert "SIGTERM: saving at step 2 and stopping" in printed["stopped"], printed["stopped"]
    assert "resumed from" in printed["resumed"] and f"reference: read from {stopped}" in printed["resumed"]
    straight, resumed = steps_of(dpo_runs["straight"]), steps_of(stopped)
    assert [m.get("step") for m in resumed] == [1, 2, 3, 3], resumed  # steps 1-2, then step 3 and the validation
    keys = ("loss", "grad_norm", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
    for ours, theirs in zip(resumed, straight):
        assert {k: ours.get(k) for k in keys + ("val_loss",)} == {k: theirs.get(k) for k in keys + ("val_loss",)}
    assert abs(resumed[2]["loss"] - math.log(2)) > 1e-3  # step 3 is off ln 2: the reference is not the policy
    trained, _ = load_model(dpo_runs["straight"] / "checkpoints", ParallelContext.single())
    assert torch.equal(run_logits(dpo_runs["trainer"].model, IDS), run_logits(trained, IDS))


def test_a_resumed_tr_dpo_run_restores_its_synced_reference(setup, dpo_runs):
    """TR-DPO (the reference moved halfway to the policy after every step, run each step from its weights), with
    dropout on (0.2: the restored generators must draw the same masks): stopped after step 2 and resumed, the
    checkpoint's synced reference comes back, so step 3 and the final validation equal the straight run's bitwise.
    Checked by hand: with the reference rebuilt from the starting weights instead (the resume's `load_reference`
    skipped), step 3's loss is 0.509 against the straight run's 0.626."""
    runs = straight_and_resumed(setup, "tr_dpo", 'preference.reference="weights"', "preference.sync_ref_model=true",
                                "preference.ref_model_sync_steps=1", "preference.ref_model_mixup_alpha=0.5",
                                "preference.disable_dropout=false", "model.dropout=0.2")
    assert "resumed from" in runs["printed"]["resumed"], runs["printed"]["resumed"]
    straight, resumed = steps_of(runs["straight"]), steps_of(runs["stopped"])
    assert [m.get("step") for m in resumed] == [1, 2, 3, 3], resumed
    keys = ("loss", "grad_norm", "rewards_chosen", "rewards_rejected", "reward_margin", "val_loss")
    for ours, theirs in zip(resumed, straight):
        assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}
    untouched = steps_of(dpo_runs["straight"])  # the same steps against the starting weights throughout
    assert abs(straight[2]["loss"] - untouched[2]["loss"]) > 1e-4, (straight, untouched)


def test_the_export_after_a_dpo_run_gives_the_runs_own_logits(setup, dpo_runs):
    """`convert --to-hf` of the resumed run's checkpoint: transformers' logits equal the run's own model's (the
    trainer that ran the last step) within 1e-5, and differ from the starting model's."""
    from transformers import AutoModelForCausalLM

    exported = setup["root"] / "exported"
    assert main(["convert", "--to-hf", str(exported), "--checkpoint", str(dpo_runs["stopped"] / "checkpoints")]) == 0
    ours = run_logits(dpo_runs["trainer"].model, IDS)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(exported).eval()(IDS).logits
        start = AutoModelForCausalLM.from_pretrained(setup["hf"]).eval()(IDS).logits
    assert rel(theirs, ours) <= 1e-5 and rel(start, ours) > 1e-3, (rel(theirs, ours), rel(start, ours))


def test_a_lora_dpo_run_exports_its_adapters_merged(setup, tmp_path):
    """A LoRA DPO run (its reference the base, adapters off), one step: `convert --to-peft --merge` and
    `convert --to-hf` of its checkpoint give the run's own logits (adapters on: the trainer that ran the steps)
    within 1e-5, and not its base's."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    overrides = [f"checkpoint.init_from={setup['hf']}", "lora.rank=8", "lora.alpha=32", "train.steps=1",
                 "train.global_batch_size=2", "train.eval_iters=0", "log.plot=false"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = train(load_config(str(setup["config"]), overrides), run_dir=run_dir)
    assert "reference: the base (adapters off)" in out.getvalue(), out.getvalue()
    ours = run_logits(result.trainer.model, IDS)
    with torch.no_grad():
        start = AutoModelForCausalLM.from_pretrained(setup["hf"]).eval()(IDS).logits
    assert rel(start, ours) > 1e-4, rel(start, ours)
    for how, flags in (("merged", ["--to-peft", str(tmp_path / "merged"), "--merge"]),
                       ("to-hf", ["--to-hf", str(tmp_path / "to-hf")])):
        assert main(["convert", *flags, "--checkpoint", str(run_dir / "checkpoints")]) == 0
        with torch.no_grad():
            theirs = AutoModelForCausalLM.from_pretrained(flags[1]).eval()(IDS).logits
        assert rel(theirs, ours) <= 1e-5, (how, rel(theirs, ours))


def copy_of(run_dir: Path, where: Path) -> Path:
    shutil.copytree(run_dir, where)
    return where


CHANGED = [
    pytest.param(lambda records: records[:-1], [], "holds 18 train pairs' reference log-probabilities; the data "
                 "has 17", id="one record fewer"),
    pytest.param(lambda records: records, ["sft.valid_fraction=0.2"], "holds 18 train pairs' reference "
                 "log-probabilities; the data has 16", id="another held-out share"),
    pytest.param(lambda records: records[::-1], [], "holds the reference log-probabilities of other train pairs "
                 "than the data's 18", id="the same pairs in another order"),
    pytest.param(lambda records: records, ["preference.ld_alpha=0.5"], "holds reference log-probabilities summed "
                 "with preference.ld_alpha=1, this run's is 0.5", id="another LD-DPO weight"),
]


@pytest.mark.parametrize("change,extra,message", CHANGED)
def test_a_restart_with_changed_data_is_refused_in_one_line(setup, dpo_runs, tmp_path, capsys, change, extra,
                                                            message):
    """Restarted (from its last checkpoint, 4 steps asked) with records or a held-out share other than its first
    start's, a run refuses the saved reference table in one line, before any step."""
    run_dir = copy_of(dpo_runs["straight"], tmp_path / "run")
    records = tmp_path / "pairs.jsonl"
    records.write_text("".join(change(setup["records"].read_text().splitlines(keepends=True))))
    code = main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", f'sft.data=["{records}"]',
                 "train.steps=4", *extra, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "changed since its first start" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert len(steps_of(run_dir)) == 4, "no step after the refusal"


def test_the_tiny_dpo_config_trains(setup, tmp_path, capsys):
    """`configs/dpo-tiny-qwen3.toml` on the pairs `scripts/dolly_pairs.py` writes (one step, shorter rows; the
    held-out share of the runs above: the config's 5 % of 20 pairs would hold out one, longer than a row), asked for
    dropout 0.2: `preference.disable_dropout` (TRL's default) turns it off, says so, and the first loss is ln 2 (with
    dropout the policy's log-probabilities would not be the reference's)."""
    code = main(["train", "configs/dpo-tiny-qwen3.toml", f"sft.data=[\"{setup['records']}\"]", "model.seq_length=512",
                 "sft.valid_fraction=0.1", "train.steps=1", "train.eval_interval=0", "train.eval_iters=1",
                 "model.dropout=0.2", "log.progress=false", "log.plot=false", "log.tensorboard=false",
                 "checkpoint.save=false", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "dropout off for preference (model.dropout=0.2 set to 0" in out.out + out.err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["dropout"] == 0.0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert abs(next(m["loss"] for m in metrics if "loss" in m) - math.log(2)) < 1e-6


def test_disable_dropout_turns_off_what_the_run_would_drop():
    """`disable_dropout` of the run's own section: model.dropout, attention dropout and LoRA's dropout to 0 for
    preference, RL and distillation runs (the line names what was on); off (`false`) or in an SFT run nothing
    changes."""
    from shardlm.config import from_dict
    from shardlm.training.run import disable_dropout

    def config(section: dict, **model):
        return from_dict({"model": {"dropout": 0.1, **model}, "lora": {"rank": 4, "dropout": 0.05}} | section)

    for section, name in (({"preference": {"loss": "sigmoid"}}, "preference"), ({"rl": {"loss": "dapo"}}, "rl"),
                          ({"distill": {"teacher": "t"}}, "distill")):
        run = config(section, attention_dropout=0.3)
        line = disable_dropout(run)
        assert (run.model.dropout, run.model.attention_dropout, run.lora.dropout) == (0.0, 0.0, 0.0)
        assert line == (f"dropout off for {name} (model.dropout=0.1, model.attention_dropout=0.3, lora.dropout=0.05 "
                        f"set to 0; {name}.disable_dropout=false keeps it)")
        kept = config({name: {**section[name], "disable_dropout": False}})
        assert disable_dropout(kept) is None and (kept.model.dropout, kept.lora.dropout) == (0.1, 0.05)
    sft = config({"sft": {"data": ["x.jsonl"]}})
    assert disable_dropout(sft) is None and sft.model.dropout == 0.1
    already = from_dict({"model": {"dropout": 0.0}, "preference": {"loss": "sigmoid"}})
    assert disable_dropout(already) is None  # nothing to turn off: no line


def bad_records(root: Path, text: str) -> list[str]:
    path = root / "bad.jsonl"
    path.write_text(text)
    return [f'sft.data=["{path}"]']


PROMPT = '"prompt": [{"role": "user", "content": "Say hi."}]'
ERRORS = [
    ("no chosen answer", lambda r: bad_records(r, '{' + PROMPT + ', "rejected": [{"role": "assistant", "content": '
                                                  '"No."}]}\n'), "bad.jsonl:1: the record has no 'chosen' answer"),
    ("identical answers", lambda r: bad_records(r, '{"prompt": "Say hi.", "chosen": "Hi.", "rejected": "Hi."}\n'),
     "'chosen' and 'rejected' are identical"),
    ("text answers without a prompt", lambda r: bad_records(r, '{"chosen": "Hi.", "rejected": "No."}\n'),
     "a text record needs a string 'prompt'"),
    ("beta", lambda r: ["preference.beta=0.0"], "preference.beta=0.0 must be > 0"),
    ("unknown loss", lambda r: ['preference.loss="kpo"'], 'preference.loss="kpo" must be one of'),
    ("unpaired records under a paired loss", lambda r: bad_records(r, '{"prompt": "Say hi.", "completion": "Hi.", '
                                                                      '"label": true}\n'),
     'bad.jsonl:1: an unpaired record (\'completion\', \'label\'); set preference.loss="kto"'),
    ("kto label", lambda r: ['preference.loss="kto"', *bad_records(r, '{"prompt": "Say hi.", "completion": "Hi.", '
                                                                       '"label": "yes"}\n')],
     "bad.jsonl:1: 'label' is 'yes'; it must be true (desirable) or false (undesirable)"),
    ("kto weight", lambda r: ['preference.loss="kto"', "preference.undesirable_weight=0"],
     "preference.desirable_weight=1 and undesirable_weight=0 must be > 0"),
    ("reference-free with a reference", lambda r: ['preference.loss="simpo"', 'preference.reference="precomputed"'],
     'preference.loss="simpo" uses no reference model'),
    ("adapters reference without LoRA", lambda r: ['preference.reference="adapters"'],
     'preference.reference="adapters" is the base of a LoRA run'),
    ("exo without its epsilon", lambda r: ['preference.loss="exo_pair"'],
     'preference.loss="exo_pair" takes its epsilon from preference.label_smoothing, which must be > 0'),
    ("unknown divergence", lambda r: ['preference.f_divergence_type="kl"'],
     'preference.f_divergence_type="kl" must be one of reverse_kl, forward_kl, js_divergence, alpha_divergence'),
    ("a divergence without a score difference", lambda r: ['preference.loss="bco_pair"',
                                                           'preference.f_divergence_type="forward_kl"'],
     'preference.f_divergence_type="forward_kl" takes preference.loss sigmoid, sigmoid_norm, ipo, hinge, robust, '
     'exo_pair, discopop, not "bco_pair"'),
    ("a sum with a reference-free loss", lambda r: ['preference.loss="sigmoid+simpo"'],
     'preference.loss="sigmoid+simpo": a sum joins sigmoid'),
    ("the sft term alone", lambda r: ['preference.loss="sft"'],
     'preference.loss="sft" is supervised fine-tuning on the answers'),
    ("the gold term alone", lambda r: ['preference.loss="gold"'],
     'preference.loss="gold" is supervised fine-tuning on the answers: add a preference loss ("sigmoid+sft", TPO\'s '
     '"cpo+gold")'),
    ("a gold term without gold answers", lambda r: ['preference.loss="cpo+gold"'],
     'pairs.jsonl:1: the record has no \'reference\' (gold) answer, which preference.loss with "gold" (TPO) trains on'),
    ("a gold answer of another kind", lambda r: ['preference.loss="cpo+gold"', *bad_records(
        r, '{"prompt": "Say hi.", "chosen": "Hi.", "rejected": "No.", "reference": [{"role": "assistant", '
           '"content": "Hello."}]}\n')],
     "bad.jsonl:1: 'reference' must be of the answers' kind (a string, or a message list)"),
    ("a gold answer off the implicit prompt", lambda r: ['preference.loss="cpo+gold"', *bad_records(
        r, '{"chosen": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}], '
           '"rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "No."}], '
           '"reference": [{"role": "user", "content": "Say no."}, {"role": "assistant", "content": "No."}]}\n')],
     "bad.jsonl:1: 'reference' does not start with the prompt 'chosen' and 'rejected' share; give a 'prompt' key"),
    ("weights for another count", lambda r: ['preference.loss="sigmoid+sft"', "preference.loss_weights=[1.0]"],
     'preference.loss_weights has 1 weights for the 2 losses of preference.loss="sigmoid+sft"'),
    ("an LD-DPO weight above 1", lambda r: ["preference.ld_alpha=1.5"],
     "preference.ld_alpha=1.5 must be in [0, 1] (1: no weighting)"),
    ("LD-DPO on a length-normalized loss", lambda r: ['preference.loss="simpo"', "preference.ld_alpha=0.5"],
     'preference.ld_alpha weighs the tokens past the shorter answer of a pair (LD-DPO); preference.loss="simpo" has '
     "its own length normalization: set it to 1"),
    ("LD-DPO without pairs", lambda r: ['preference.loss="kto"', "preference.ld_alpha=0.5"],
     'preference.loss="kto" has no pairs: set it to 1'),
    ("TR-DPO with a precomputed reference", lambda r: ["preference.sync_ref_model=true",
                                                       'preference.reference="precomputed"'],
     'preference.sync_ref_model moves the reference as the run trains; preference.reference="precomputed" holds it '
     'fixed (precomputed once): use "weights" (or "auto")'),
    ("TR-DPO without a reference", lambda r: ['preference.loss="simpo"', "preference.sync_ref_model=true"],
     'preference.sync_ref_model updates the reference, which preference.loss="simpo" does not use'),
    ("TR-DPO under LoRA", lambda r: ["preference.sync_ref_model=true", "lora.rank=4"],
     "a LoRA run's reference is its base (adapters off)"),
    ("a weights reference under LoRA", lambda r: ['preference.reference="weights"', "lora.rank=4"],
     'a LoRA run\'s reference is its base: use "adapters"'),
    ("WPO without a reference", lambda r: ['preference.loss="orpo"', "preference.use_weighting=true"],
     'preference.use_weighting (WPO) weighs the pairs of the losses with a reference; preference.loss="orpo" takes '
     "none: set it to false"),
    ("WPO under AOT", lambda r: ['preference.loss="aot"', "preference.use_weighting=true"],
     'preference.use_weighting (WPO) is not defined for preference.loss="aot", which sorts the pairs\' log-ratios '
     "across the batch (TRL refuses it too): set it to false"),
    ("AOT with dropout", lambda r: ['preference.loss="aot_unpaired"', "preference.disable_dropout=false",
                                    "model.dropout=0.2"],
     'preference.loss="aot_unpaired" ranks the global batch\'s pairs in a pass before the step, which must see the '
     "step's values: set preference.disable_dropout=true (or the dropouts to 0)"),
    ("DFT in a preference run", lambda r: ['sft.loss_type="dft"'],
     'sft.loss_type="dft" weighs the SFT loss; a preference, RL, distillation or reward-model run has '
     'its own: leave it at "nll"'),
    ("AlphaPO on DPO", lambda r: ["preference.alpha=0.1"],
     'preference.alpha (AlphaPO) shapes the rewards of simpo, cpo, cpo_hinge, cpo_ipo, not preference.loss="sigmoid"'),
    ("ORPO with a second NLL", lambda r: ['preference.loss="orpo+sft"'],
     'preference.loss="orpo+sft": a sum joins sigmoid'),
    ("a reference-free loss with a referenced one", lambda r: ['preference.loss="cpo+sigmoid"'],
     'or one of simpo, cpo, cpo_hinge, cpo_ipo, "sft" and "gold" (CPO: "cpo+sft", TPO: "cpo+gold")'),
    ("two AOT losses", lambda r: ['preference.loss="aot+aot_unpaired"'],
     'preference.loss="aot+aot_unpaired" sums two AOT losses; keep one of aot, aot_unpaired'),
]


@pytest.mark.parametrize("name,extra,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_preference_errors_are_one_line(setup, tmp_path, capsys, name, extra, message):
    workdir = tmp_path / "case"
    workdir.mkdir()
    code = main(["train", str(setup["config"]), f"checkpoint.init_from={setup['hf']}", *extra(workdir),
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


def test_the_pairs_script_refuses_a_missing_file(tmp_path, capsys):
    module = runpy.run_path(str(ROOT / "scripts" / "dolly_pairs.py"))
    assert module["main"]([str(tmp_path / "none.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()
