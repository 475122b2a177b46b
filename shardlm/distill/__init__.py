"""Knowledge distillation from a frozen teacher at the training layout (`docs/distillation.md`): the teacher
(`teacher`; sharded over DP under FSDP), the generalized Jensen-Shannon divergence over vocabulary-parallel logits
(`divergence`) and the trainer's loss (`loss`)."""

from __future__ import annotations


def check_distill(config, check_paths: bool = True) -> str | None:
    """A one-line problem with a run's [distill] settings, or None (checked before any expensive work; with
    `check_paths`, the teacher is opened and its vocabulary compared with the student's)."""
    d, m = config.distill, config.model
    checks = [
        (d.loss in ("jsd", "token_kl", "iw_opd"), f'distill.loss="{d.loss}" must be "jsd", "token_kl" or "iw_opd"'),
        (d.iw_opd_gamma >= 0, f"distill.iw_opd_gamma={d.iw_opd_gamma} must be >= 0 (0: token_kl's gradient)"),
        (d.iw_opd_epsilon > 0, f"distill.iw_opd_epsilon={d.iw_opd_epsilon} must be > 0"),
        (d.loss != "iw_opd" or d.lmbda == 1, f"distill.loss=\"iw_opd\" weighs the student's own samples; set "
                                               f"distill.lmbda=1 (every step on-policy), not {d.lmbda}"),
        (0 <= d.beta <= 1, f"distill.beta={d.beta} must be in [0, 1] (0: forward KL, 1: reverse KL)"),
        (d.loss_top_k >= 0, f"distill.loss_top_k={d.loss_top_k} must be >= 0 (0: the whole vocabulary)"),
        (not d.loss_top_k or d.loss == "jsd",
         f'distill.loss_top_k restricts the "jsd" divergence to a support; distill.loss="{d.loss}" reads the sampled '
         "tokens alone: set it to 0"),
        (d.reverse_kl_top_1_mode in ("sampled", "argmax"),
         f'distill.reverse_kl_top_1_mode="{d.reverse_kl_top_1_mode}" must be "sampled" or "argmax"'),
        (d.temperature > 0, f"distill.temperature={d.temperature} must be > 0"),
        (d.teacher_dtype in ("fp32", "bf16"), f'distill.teacher_dtype="{d.teacher_dtype}" must be "fp32" or "bf16"'),
        (0 <= d.lmbda <= 1, f"distill.lmbda={d.lmbda} must be in [0, 1] (the share of on-policy steps)"),
        (d.max_new_tokens >= 1, f"distill.max_new_tokens={d.max_new_tokens} must be at least 1"),
        (d.sampling_temperature > 0, f"distill.sampling_temperature={d.sampling_temperature} must be > 0"),
        (0 < d.top_p <= 1, f"distill.top_p={d.top_p} must be in (0, 1]"),
        (d.top_k >= 0, f"distill.top_k={d.top_k} must be >= 0 (0 disables it)"),
        (0 <= d.min_p <= 1, f"distill.min_p={d.min_p} must be in [0, 1] (0 disables it)"),
        (d.repetition_penalty > 0, f"distill.repetition_penalty={d.repetition_penalty} must be > 0 (1 disables it)"),
        (m.arch in ("gpt", "llama"), f"distill takes a decoder student (model.arch gpt or llama), not {m.arch}"),
        (bool(config.sft.data), "distill scores the answers of [sft] records; set sft.data"),
        (not config.preference.loss and not config.rl.loss,
         "distill, preference and rl are different losses; set one of [distill].teacher, preference.loss, rl.loss"),
        (not m.mtp_layers, "distill trains the next-token distribution only; set model.mtp_layers=0"),
    ]
    for ok, message in checks:
        if not ok:
            return message
    if d.lmbda > 0 or d.seq_kd:
        from shardlm.rl import sampling_split_problem

        if (problem := sampling_split_problem(config)) is not None:
            return problem
    if check_paths:
        return check_teacher(config)
    return None


def check_teacher(config) -> str | None:
    """The teacher exists and shares the student's vocabulary: the same size (once the student's is known: a run
    from scratch takes its tokenizer's, `shardlm.training.run`), the same tokens where both have a tokenizer."""
    from pathlib import Path

    from shardlm.distill.teacher import open_teacher
    from shardlm.errors import UserError

    try:
        source = open_teacher(config.distill.teacher)
    except UserError as error:
        return str(error)
    theirs, ours = source.config.model.vocab_size, config.model.vocab_size
    if ours and theirs != ours:
        return (f"distill.teacher={config.distill.teacher} has a vocabulary of {theirs} entries, the student "
                f"{ours}; a teacher must share the student's vocabulary (with the same tokenizer, set "
                f"model.vocab_size={theirs})")
    mine = _tokenizer_file(config)
    teacher_file = Path(config.distill.teacher) / "tokenizer.json"
    if mine is not None and teacher_file.is_file() and not _same_bytes(mine, teacher_file) and \
            _vocabulary(mine) != _vocabulary(teacher_file):
        return (f"distill.teacher={config.distill.teacher} has another tokenizer than the student's ({mine}): their "
                "vocabularies do not map one to one")
    return None


def _tokenizer_file(config):
    from pathlib import Path

    for candidate in (config.sft.tokenizer, config.data.tokenizer, config.checkpoint.init_from):
        if candidate:
            path = Path(candidate)
            path = path / "tokenizer.json" if path.is_dir() else path
            if path.is_file() and path.suffix == ".json":
                return path
    return None


def _same_bytes(a, b) -> bool:
    """Whether two files hold the same bytes (the common case, one tokenizer copied: no parsing needed)."""
    import filecmp

    return filecmp.cmp(a, b, shallow=False)


def _vocabulary(path) -> dict:
    from shardlm.data.tokenizers import shared_tokenizer

    return shared_tokenizer(path).get_vocab()
