"""TRL 1.16's distillation trainers as external oracles for shardlm's `[distill]` run, step by step.

A random two-layer Qwen3 student (tied embedding) and a larger random three-layer Qwen3 teacher (hidden 128,
untied output layer scaled up so its distributions are far from uniform), both with the real 151,936-token Qwen3
vocabulary, are saved as Hugging Face directories (the student's with the shared Qwen3 chat tokenizer). Both
trainers read the same 4 short Dolly records and train 2 steps of 2 conversations each on the same tokens:

- shardlm renders and masks the records with its chat template (the answer from `<think>` through `<|im_end|>`, the
  newline after it not trained) and packs one conversation a row (`sft.packing = "pad"`, in the records' order),
  one row a micro-batch, 2 a step.
- TRL gets the same ids: `GKDTrainer` (lmbda 0: no on-policy generation, seq_kd off) reads each conversation's
  ids up to `<|im_end|>` and where its answer starts (`DataCollatorForChatML`'s `completion_mask`), one a micro-batch
  and 2 accumulation steps, in order; `DistillationTrainer` renders the prompts itself (their ids must equal
  shardlm's, or the test fails) and a subclass's `_generate_single_turn` answers each with shardlm's answer ids
  instead of sampling (2 prompts a generation batch, one a micro-batch). `setup` also checks that TRL's collator,
  given the records' messages, renders exactly shardlm's ids (plus the newline) and answer start.

Both train in fp32 with the same AdamW (betas 0.9 / 0.999, no weight decay, eps 1e-4), a constant learning rate
and clipping at 1.0, and both divide the step's summed divergence by its answer tokens (TRL's `num_items_in_batch`
over the accumulation steps, shardlm's global `divisor`). `GKDTrainer`'s loss ignores its temperature (it only
samples with it), so temperature 1 is compared with it; `DistillationTrainer` divides both models' logits by its
temperature (no T^2 factor), so temperature 2 is compared with it. Each step's loss and gradient norm agree within
TOL = 1e-5 relative for beta 0, 0.25, 0.5 and 1 (measured: at most 5.2e-7 for a loss, 6.6e-7 a gradient norm). A
control run whose divergence swaps the student's and the teacher's sides (a local copy monkeypatched into
`shardlm.distill.loss`) misses TRL's beta 0.25 run by far more. Other mutations tried by hand miss by far more too:
temperature 2 ignored (1.8 loss, 1.0 gradient norm), beta 0 and 1 exchanged (6.2e-3 and 9.5e-4 loss, 0.54 and
9.1e-2 gradient norm), each micro-batch divided by its own answer tokens instead of the step's (3.4e-3, 9.3e-2).
On-policy steps (`lmbda = 1`): `DistillationTrainer` is handed shardlm's sampled completions
(`test_on_policy_steps_follow_trl`); so is `IWOPDTrainer`, for IW-OPD and for its "jsd" objective on a top-k support
(`distill.loss_top_k`: the teacher's top token and the sampled one with the tail, measured 3.2e-7 loss and 2.4e-7
gradient norm; both top-4 renormalized, 1.1e-7 and 1.0e-7), whose whole-vocabulary JSD on the same samples misses.
"""

from __future__ import annotations

import json
import math
import shutil
import types

import pytest
import torch
from chat_cache import template_parsed_once  # noqa: F401 (parses the chat template once per module)
from llama_reference import spread_norm_weights

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from shardlm.bench.common import uncached_datasets  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.sft.records import load_conversations  # noqa: E402
from shardlm.sft.template import ChatTemplate, tokenize_conversations  # noqa: E402
from shardlm.training.run import train  # noqa: E402

SEQ, CONVERSATIONS, PER_STEP, STEPS = 48, 4, 2, 2
LR, ADAM_EPS, SEED, TOL = 1e-3, 1e-4, 0, 1e-5
BETAS = (0.0, 0.25, 0.5, 1.0)
QWEN3 = {"vocab_size": 151936, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ}
STUDENT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16,
           "tie_word_embeddings": True}
TEACHER = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "head_dim": 32,
           "tie_word_embeddings": False}


def save_qwen3(folder, data_dir, seed: int, output_scale: float = 1.0, tokenizer: bool = True, **sizes):
    """A random Qwen3 of `sizes` (seed `seed`, norm weights spread, output layer times `output_scale`) saved in
    `folder`, with the shared chat tokenizer beside it if `tokenizer`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3, **sizes))
    assert spread_norm_weights(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(output_scale)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
        shutil.copy(data_dir / "chat" / "qwen3" / name, folder / name)
    return folder


def short_records(data_dir, template: ChatTemplate) -> list[str]:
    """The first CONVERSATIONS of the first 40 Dolly lines whose conversation fits a row of SEQ tokens."""
    path = data_dir / "chat" / "dolly-15k-first600.jsonl"
    docs = tokenize_conversations(template, load_conversations(path, limit=40))
    lines = [line for line, doc in zip(path.read_text().splitlines(), docs) if len(doc.input_ids) < SEQ]
    assert len(lines) >= CONVERSATIONS, "too few short Dolly records"
    return lines[:CONVERSATIONS]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    """The student and teacher directories and the records (records.jsonl) under `root`; "conversations": per
    record its messages, `ids` (shardlm's tokens up to and including the answer's `<|im_end|>`), `start` (the
    first answer token) and `trailing` (the untrained tokens after it: the template's newline); TRL's
    "teacher_model" and "tokenizer", shared by its runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.utils import DataCollatorForChatML

    root = tmp_path_factory.mktemp("distill_trl")
    student = save_qwen3(root / "student", data_dir, seed=0, **STUDENT)
    # no tokenizer beside the teacher: shardlm then checks its vocabulary size only, not token by token (parsing two
    # 11 MB tokenizer.json files: 2.4 s of CPU a run); TRL reads the student's
    teacher = save_qwen3(root / "teacher", data_dir, seed=1, output_scale=8.0, tokenizer=False, **TEACHER)
    template = ChatTemplate.from_dir(student)
    (root / "records.jsonl").write_text("\n".join(short_records(data_dir, template)) + "\n")
    records = load_conversations(root / "records.jsonl")
    conversations = []
    for record, doc in zip(records, tokenize_conversations(template, records)):
        start, end = doc.loss_mask.index(1), len(doc.loss_mask) - doc.loss_mask[::-1].index(1)
        assert all(doc.loss_mask[start:end]) and doc.input_ids[end - 1] == template.end_of_turn_id, record.where
        conversations.append({"messages": record.messages, "ids": doc.input_ids[:end], "start": start,
                              "trailing": doc.input_ids[end:]})
    tokenizer = AutoTokenizer.from_pretrained(student)
    collator = DataCollatorForChatML(tokenizer=tokenizer, max_length=SEQ)
    for c in conversations:  # TRL's own rendering: the same ids and answer start, and it would train the newline
        batch = collator([{"messages": c["messages"]}])
        assert batch["input_ids"][0].tolist() == c["ids"] + c["trailing"]
        assert (batch["labels"][0] != -100).int().argmax().item() == c["start"]
    # loaded once for every TRL run: the teacher is frozen (TRL only evaluates it) and the trainers only set the
    # tokenizer's pad token, the same each time; each run loads its own student (trained in place)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    return {"root": root, "student": student, "teacher": teacher, "conversations": conversations,
            "teacher_model": teacher_model, "tokenizer": tokenizer}


def trl_args(cls, setup, name: str, **options):
    """`cls` (a TRL config class) with the settings every run shares: fp32 on the CPU, the AdamW and schedule of
    `shardlm_steps`, one conversation a micro-batch and PER_STEP a step."""
    return cls(output_dir=str(setup["root"] / f"trl_{name}"), per_device_train_batch_size=1,
               gradient_accumulation_steps=PER_STEP, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
               warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=ADAM_EPS,
               max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=SEED,
               dataloader_num_workers=0, disable_tqdm=True, bf16=False, gradient_checkpointing=False, **options)


def trl_models(setup):
    """A TRL trainer's models: a fresh student, the shared frozen teacher and tokenizer."""
    from transformers import AutoModelForCausalLM

    return {"model": AutoModelForCausalLM.from_pretrained(setup["student"], dtype=torch.float32),
            "teacher_model": setup["teacher_model"], "processing_class": setup["tokenizer"]}


def gkd_steps(setup, beta: float, name: str = "", trainer_class=None, **options) -> list[dict]:
    """`GKDTrainer`'s (or `trainer_class`'s) logged steps at `beta` on shardlm's ids, off-policy (lmbda 0, no
    sequence-level KD unless `options` say so)."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    rows = [{"messages": c["messages"], "input_ids": c["ids"],
             "completion_mask": [int(i >= c["start"]) for i in range(len(c["ids"]))]}
            for c in setup["conversations"]]
    args = trl_args(GKDConfig, setup, name or f"gkd_{beta}", **({"lmbda": 0.0, "seq_kd": False} | options),
                    beta=beta, max_length=SEQ, train_sampling_strategy="sequential")
    with uncached_datasets():
        trainer = (trainer_class or GKDTrainer)(args=args, train_dataset=datasets.Dataset.from_list(rows),
                                                **trl_models(setup))
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def distillation_steps(setup, beta: float, temperature: float, answers: dict | None = None) -> list[dict]:
    """`DistillationTrainer`'s logged steps at `beta` and `temperature`, each rendered prompt answered with
    shardlm's answer ids (or `answers`' ids for its prompt ids) instead of a sampled completion."""
    answers = answers or {tuple(c["ids"][:c["start"]]): c["ids"][c["start"]:] for c in setup["conversations"]}

    class FixedCompletions(trl.DistillationTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
            missing = [ids for ids in prompt_ids if tuple(ids) not in answers]
            assert not missing, f"TRL rendered a prompt unlike shardlm's template: {missing}"
            return [list(answers[tuple(ids)]) for ids in prompt_ids]

    args = trl_args(trl.DistillationConfig, setup, f"distillation_{beta}_{temperature}_{len(answers)}", beta=beta,
                    temperature=temperature, max_completion_length=SEQ, shuffle_dataset=False)
    prompts = [{"prompt": c["messages"][:-1]} for c in setup["conversations"]]
    with uncached_datasets():
        trainer = FixedCompletions(args=args, train_dataset=datasets.Dataset.from_list(prompts), **trl_models(setup))
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def iw_opd_steps(setup, temperature: float, answers: dict, name: str = "iw_opd", **options) -> list[dict]:
    """`IWOPDTrainer`'s logged steps (its "iw_opd" objective, or `options`' ("jsd"); every step on-policy) with each
    prompt answered by `answers`' ids for its prompt ids instead of its student's `generate`. A collator hands it each
    conversation's prompt ids as shardlm cuts them, in the records' order, and each micro-batch's left padding (from
    the other prompt of its generation batch) is cut, since its forward would shift a left-padded row's positions.
    Its loss divides by the answer tokens the trainer counted in the collated batch before the generation (none in a
    batch of prompts: 0, a NaN loss); it is handed the step's completion tokens instead, as shardlm counts them."""
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    def left(values, fill):
        width = max(map(len, values))
        return torch.tensor([[fill] * (width - len(v)) + list(v) for v in values])

    def collate(examples):
        prompts = [e["prompt"] for e in examples]
        return {"input_ids": left(prompts, 0), "attention_mask": left([[1] * len(p) for p in prompts], 0),
                "labels": left([[-100] * len(p) for p in prompts], -100), "prompts": left(prompts, 0),
                "prompt_attention_mask": left([[1] * len(p) for p in prompts], 0)}

    class Answered(IWOPDTrainer):
        @staticmethod
        def _local_teacher_tokenizers_match(student, teacher):
            return True  # the teacher's directory holds no tokenizer (see `setup`); it shares the student's

        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(dataset if dataset is not None else self.train_dataset)

        def _fill_buffer(self, generation_batch, buffer_steps):
            super()._fill_buffer(generation_batch, buffer_steps)
            for i, part in enumerate(self._buffered_inputs):
                real = part["attention_mask"].bool().any(0)
                self._buffered_inputs[i] = {k: v[:, real] if k in ("input_ids", "attention_mask", "labels") else v
                                            for k, v in part.items()}

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            tokens = sum(int((part["labels"] != -100).sum()) for part in self._buffered_inputs)
            return super().compute_loss(model, inputs, return_outputs, tokens)

    def generate(input_ids, attention_mask, **_):
        completions = [answers[tuple(ids[mask.bool()].tolist())] for ids, mask in zip(input_ids, attention_mask)]
        pad = setup["tokenizer"].pad_token_id
        tails = [c + [pad] * (max(map(len, completions)) - len(c)) for c in completions]
        return types.SimpleNamespace(sequences=torch.cat([input_ids, torch.tensor(tails)], dim=1))

    options = {"distillation_objective": "iw_opd", "iw_opd_gamma": 0.5} | options
    args = trl_args(IWOPDConfig, setup, f"{name}_{temperature}", temperature=temperature, lmbda=1.0, max_length=SEQ,
                    max_completion_length=SEQ - 8, **options)
    rows = [{"prompt": c["ids"][:c["start"]]} for c in setup["conversations"]]
    models = trl_models(setup)
    models["model"].generate = generate
    with uncached_datasets():
        trainer = Answered(args=args, data_collator=collate, train_dataset=datasets.Dataset.from_list(rows), **models)
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def shardlm_steps(setup, name: str, beta: float, temperature: float, *more: str) -> list[dict]:
    """shardlm's metrics.jsonl steps: the student directory distilled from the teacher's on the records, one
    conversation a row and a micro-batch, PER_STEP a step, in the records' order; `more`: further overrides."""
    overrides = [f"checkpoint.init_from={setup['student']}", "checkpoint.save=false",
                 f"sft.data=[\"{setup['root'] / 'records.jsonl'}\"]", 'sft.packing="pad"', "sft.shuffle=false",
                 "sft.valid_fraction=0.0", f"distill.teacher=\"{setup['teacher']}\"", f"distill.beta={beta}",
                 f"distill.temperature={temperature}", f"model.seq_length={SEQ}", "train.micro_batch_size=1",
                 f"train.global_batch_size={PER_STEP}", f"train.steps={STEPS}", f"train.seed={SEED}",
                 f"train.lr={LR}", f"train.min_lr={LR}", "train.decay_style=\"constant\"", "train.warmup_steps=0",
                 "train.weight_decay=0.0", "train.adam_beta1=0.9", "train.adam_beta2=0.999",
                 f"train.adam_eps={ADAM_EPS}", "train.clip_grad=1.0", "train.device=\"cpu\"",
                 "train.precision=\"fp32\"", "log.interval=1", "log.progress=false", "log.plot=false",
                 "log.tensorboard=false", *more]
    run_dir = setup["root"] / f"shardlm_{name}"
    train(load_config(None, overrides), run_dir=run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"val_loss"' not in line]


def differences(ours: list[dict], theirs: list[dict]) -> dict:
    """{"loss" / "grad_norm": the largest |shardlm - TRL| / |TRL| over the steps}."""
    assert len(ours) == len(theirs) == STEPS, (ours, theirs)
    return {key: max(abs(mine[key] - trls[key]) / abs(trls[key]) for mine, trls in zip(ours, theirs))
            for key in ("loss", "grad_norm")}


# (oracle, temperature): GKDTrainer's loss is at temperature 1 whatever its setting; DistillationTrainer's at its own
ORACLES = {"gkd": 1.0, "distillation": 2.0}


@pytest.fixture(scope="module")
def runs(setup):
    """`runs(oracle, beta)`: (TRL's steps, shardlm's steps), each pair run once per module."""
    done: dict = {}

    def run(oracle: str, beta: float) -> tuple[list[dict], list[dict]]:
        if (oracle, beta) not in done:
            temperature = ORACLES[oracle]
            theirs = gkd_steps(setup, beta) if oracle == "gkd" else distillation_steps(setup, beta, temperature)
            done[oracle, beta] = theirs, shardlm_steps(setup, f"{oracle}_{beta}", beta, temperature)
        return done[oracle, beta]

    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("oracle", list(ORACLES))
def test_distillation_follows_trl_step_by_step(runs, oracle, beta):
    """Each step's loss and gradient norm within TOL of TRL's (measured: at most 6.6e-7). The step after the first
    sees AdamW's update: without it (learning rate 1e-9) shardlm's second step of beta 0.5 misses TRL's by 3.5e-4
    (loss) and 6.3e-3 (gradient norm)."""
    theirs, ours = runs(oracle, beta)
    worst = differences(ours, theirs)
    assert all(value <= TOL for value in worst.values()), (worst, ours, theirs)
    assert all(log["loss"] > 0 and log["grad_norm"] > 0 for log in theirs), theirs


def swapped_divergence(student, teacher, tp, vocab_size, beta, temperature=1.0):
    """The control's bug, one process: `generalized_jsd` with the student's and the teacher's sides swapped (the
    student still the one with a gradient), for 0 < beta < 1."""
    s = torch.log_softmax(teacher.detach().float()[..., :vocab_size] / temperature, dim=-1)
    t = torch.log_softmax(student.float()[..., :vocab_size] / temperature, dim=-1)
    mixture = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return (beta * t.exp() * (t - mixture) + (1 - beta) * s.exp() * (s - mixture)).sum(dim=-1)


@pytest.mark.timeout(120)
def test_swapped_sides_miss_trl(setup, runs, monkeypatch):
    """The control: at beta 0.25 (not symmetric: swapped sides are beta 0.75) the swapped divergence misses TRL's
    run by far more than TOL, so the comparison above can fail. The gradient norm moves most (measured 5.8e-2); the
    loss less (6.9e-4), as the divergences of beta and 1 - beta agree to second order in the distributions'
    difference (both beta (1 - beta) / 2 times its chi-squared)."""
    theirs, _ = runs("gkd", 0.25)
    monkeypatch.setattr("shardlm.distill.loss.generalized_jsd", swapped_divergence)
    worst = differences(shardlm_steps(setup, "swapped", 0.25, 1.0), theirs)
    assert worst["grad_norm"] > 1000 * TOL and worst["loss"] > 10 * TOL, worst


def record_samples(monkeypatch) -> dict:
    """{prompt ids: completion ids} of every sequence shardlm's generator samples from now on in this test."""
    from shardlm.rl import rollout

    sampled = {}
    generate = rollout.InProcessGenerator.generate

    def recording(self, prompts, seeds, round_index=0, sequences=None):
        rollouts = generate(self, prompts, seeds, round_index, sequences)
        sampled.update({tuple(r.prompt): list(r.completion) for r in rollouts})
        return rollouts

    monkeypatch.setattr(rollout.InProcessGenerator, "generate", recording)
    return sampled


@pytest.mark.timeout(180)
def test_on_policy_steps_follow_trl(setup, runs, monkeypatch):
    """On-policy steps (`distill.lmbda = 1`): shardlm's student completes each conversation's prompt (at most 6
    tokens, sampled at temperature 1; recorded), and TRL's `DistillationTrainer` is handed those completions for the
    same prompts. Each step's loss and gradient norm within TOL at beta 0.5 and temperature 2. Beyond the offline
    comparison this checks shardlm's on-policy path: the prompt cut before the last answer, the sampled rows (one
    conversation a row here: two prompts and completions do not fit 48 tokens) and their masks (measured: within
    6.3e-7 for a loss, 3.7e-7 a gradient norm). The control: TRL's run on the records' own answers is far off (4e-2)."""
    sampled = record_samples(monkeypatch)
    ours = shardlm_steps(setup, "on_policy", 0.5, 2.0, "distill.lmbda=1.0", "distill.max_new_tokens=6")
    assert all(log["on_policy"] == 1 for log in ours), ours
    answers = {tuple(c["ids"][:c["start"]]): c["ids"][c["start"]:] for c in setup["conversations"]}
    assert sampled.keys() == answers.keys() and all(0 < len(ids) <= 6 for ids in sampled.values()), sampled
    assert all(sampled[prompt] != answers[prompt][:len(sampled[prompt])] for prompt in answers)
    worst = differences(ours, distillation_steps(setup, 0.5, 2.0, sampled))
    assert all(value <= TOL for value in worst.values()), worst
    offline = differences(ours, runs("distillation", 0.5)[0])
    assert offline["loss"] > 1000 * TOL, offline


@pytest.mark.timeout(180)
def test_seq_kd_steps_follow_trls_gkd(setup, runs, monkeypatch):
    """Sequence-level KD (`distill.seq_kd` with lmbda 0: every step on the teacher's completions): `GKDTrainer` with
    `seq_kd` has the teacher complete each conversation's prompt (at most 6 tokens) with transformers' `generate`,
    shardlm samples them with its teacher at the training layout; both at temperature 1e-3, which leaves the
    teacher's most likely token (its output layer is scaled up, its logits far apart), so both train on the same
    completions (recorded on both sides and compared). Each step's loss and gradient norm within TOL (beta 0.5; GKD's
    loss is at temperature 1 whatever its sampling temperature). TRL divides a step's summed divergence by the answer
    tokens its batch held before `seq_kd` replaced the answers (the records' answers, 2.9 times the completions'
    here: its loss would be off by that factor); the oracle is handed the step's completion tokens instead (2 x 6),
    as shardlm counts the tokens it trains. The control: GKD's offline run is far off."""
    from trl.experimental.gkd import GKDTrainer

    theirs_sampled = {}
    generate = GKDTrainer.generate_on_policy_outputs

    def trl_recording(model, inputs, generation_config):
        ids, mask, labels = generate(model, inputs, generation_config)
        prompt = inputs["prompts"][0].tolist()
        theirs_sampled[tuple(prompt)] = ids[0, len(prompt):].tolist()
        return ids, mask, labels

    class CompletionTokens(GKDTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, PER_STEP * 6)

    monkeypatch.setattr(GKDTrainer, "generate_on_policy_outputs", staticmethod(trl_recording))
    ours_sampled = record_samples(monkeypatch)
    theirs = gkd_steps(setup, 0.5, "gkd_seq_kd", CompletionTokens, seq_kd=True, temperature=1e-3, max_new_tokens=6)
    ours = shardlm_steps(setup, "seq_kd", 0.5, 1.0, "distill.seq_kd=true", "distill.max_new_tokens=6",
                         "distill.sampling_temperature=1e-3")
    assert all(log["seq_kd"] == 1 and log["on_policy"] == 0 for log in ours), ours
    answers = {tuple(c["ids"][:c["start"]]): c["ids"][c["start"]:] for c in setup["conversations"]}
    assert ours_sampled == theirs_sampled and ours_sampled.keys() == answers.keys(), (ours_sampled, theirs_sampled)
    assert all(len(ids) == 6 and ids != answers[prompt][:6] for prompt, ids in ours_sampled.items()), ours_sampled
    worst = differences(ours, theirs)
    assert all(value <= TOL for value in worst.values()), worst
    offline = differences(ours, runs("gkd", 0.5)[0])
    assert offline["loss"] > 1000 * TOL, offline


@pytest.mark.timeout(180)
def test_iw_opd_follows_trls_iw_opd_trainer(setup, monkeypatch):
    """`distill.loss = "iw_opd"` (gamma 0.5, temperature 2, every step on-policy): shardlm's student completes each
    prompt (at most 6 tokens; recorded) and `IWOPDTrainer` (its "iw_opd" objective) is handed those completions:
    each step's gradient norm within TOL (measured 2.1e-7), its loss within TOL of max(1, |loss|) (measured 3e-6
    absolute: the loss sums terms w a log p of both signs, the mean advantage 0.03 against a mean |a| of 1.2, each
    term about 20, so a relative bound on the sum would amplify fp32 rounding fifty-fold). The control: the same
    samples under token_kl's loss (no weights) are far off (gradient norm 0.25 relative)."""
    sampled = record_samples(monkeypatch)
    on_policy = ("distill.lmbda=1.0", "distill.max_new_tokens=6")
    ours = shardlm_steps(setup, "iw_opd", 0.5, 2.0, 'distill.loss="iw_opd"', "distill.iw_opd_gamma=0.5", *on_policy)
    assert len(sampled) == CONVERSATIONS and all(0 < len(ids) <= 6 for ids in sampled.values()), sampled
    theirs = iw_opd_steps(setup, 2.0, sampled)
    worst = differences(ours, theirs)
    assert worst["grad_norm"] <= TOL, (worst, ours, theirs)
    assert all(abs(mine["loss"] - trls["loss"]) <= TOL * max(1.0, abs(trls["loss"]))
               for mine, trls in zip(ours, theirs)), (ours, theirs)
    assert all(log["iw_opd/max_weight"] == 1.5 for log in ours), ours
    token_kl = shardlm_steps(setup, "iw_opd_token_kl", 0.5, 2.0, 'distill.loss="token_kl"', *on_policy)
    unweighted = differences(token_kl, theirs)
    assert unweighted["grad_norm"] > 1000 * TOL, unweighted


@pytest.mark.parametrize("top_k, tail", [(1, True), (4, False)], ids=["top 1 tail", "top 4 renormalized"])
def test_top_k_jsd_follows_trls_iw_opd_trainer(setup, monkeypatch, top_k, tail):
    """`distill.loss_top_k` on the JSD (beta 0.5, temperature 2, every step on-policy): `IWOPDTrainer`'s "jsd"
    objective handed shardlm's completions, with its default support (the teacher's top token and the sampled one,
    with the tail bucket) and the union of both top-4 renormalized: each step's loss and gradient norm within TOL; the
    whole vocabulary's JSD on the same samples misses the gradient norm."""
    sampled = record_samples(monkeypatch)
    on_policy = ("distill.lmbda=1.0", "distill.max_new_tokens=6")
    support = (f"distill.loss_top_k={top_k}", f"distill.loss_add_tail={str(tail).lower()}")
    ours = shardlm_steps(setup, f"top_{top_k}", 0.5, 2.0, *support, *on_policy)
    theirs = iw_opd_steps(setup, 2.0, sampled, f"jsd_top_{top_k}", distillation_objective="jsd", beta=0.5,
                          loss_top_k=top_k, loss_add_tail=tail)
    worst = differences(ours, theirs)
    assert worst["grad_norm"] <= TOL and worst["loss"] <= TOL, (worst, ours, theirs)
    whole = shardlm_steps(setup, f"top_{top_k}_whole", 0.5, 2.0, *on_policy)
    assert differences(whole, theirs)["grad_norm"] > 100 * TOL
