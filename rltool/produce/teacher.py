"""On-policy distillation at production time: a teacher scores the student's own samples.

Shape legend: T = len(input_ids) of one sample, N = tokens in one packed row of the
teacher's forward, V = vocabulary, K = top-k width. Design: docs/production.md#teacher-scoring
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rltool.config.schema import DistillConfig, ModelConfig
from rltool.models import load_model_and_tokenizer, model_device
from rltool.packing import pack_lengths
from rltool.rollout.state import RolloutState, Status, TeacherTargets


def check_same_tokenizer(teacher_tok, teacher_path: str, student_tok, student_path: str) -> None:
    """Token ids mean the same to both models, or a ValueError naming both paths."""
    same = (
        teacher_tok.get_vocab() == student_tok.get_vocab()
        and teacher_tok.eos_token_id == student_tok.eos_token_id
        and teacher_tok.pad_token_id == student_tok.pad_token_id
    )
    if not same:
        raise ValueError(
            f"distill.teacher_path {teacher_path!r} and model.path {student_path!r} have different "
            "tokenizers (vocabulary or special tokens differ); the teacher scores the student's "
            "token ids, so both must share one tokenizer"
        )


def teacher_targets_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    starts: torch.Tensor,
    kind: str,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [N, K], logprobs [N, K]) of one row, unshifted: row p describes input_ids[p].

    ``logits`` [N, V] are the teacher's (already temperature-scaled) logits of a
    row holding samples back to back; ``starts`` ([S] long) are the samples'
    first positions, which get the placeholder (nothing predicts them).
    """
    logits = logits.float()  # [N, V]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    if kind == "topk":
        values, ids = logits.topk(top_k, dim=-1)  # [N, K]
        lps = values - lse  # [N, K]
    else:  # sampled: the logprob of the token that follows
        ids = input_ids.roll(-1)[:, None]  # [N, 1], row p: the token at p + 1
        lps = logits.gather(-1, ids) - lse  # [N, 1]
    # row p-1 predicts token p: move everything down one row, placeholders at the starts
    token_ids = ids.roll(1, dims=0)  # [N, K]
    logprobs = lps.roll(1, dims=0)  # [N, K]
    token_ids[starts] = input_ids[starts, None]
    logprobs[starts] = 0.0
    return token_ids, logprobs


class TeacherScorer:
    """The teacher of on-policy distillation: fills ``teacher_targets`` of generated samples.

    ``model``/``tokenizer`` given: use them (tests, or a teacher already loaded);
    otherwise load ``cfg.teacher_path`` with the policy's loader on ``device``
    (default: the recipe's ``auto``). ``student_tokenizer`` given: it must equal
    the teacher's (``check_same_tokenizer``). The teacher scores at temperature
    1, its own distribution; ``max_tokens`` bounds one forward's packed row
    (attention is quadratic in the row length).
    """

    def __init__(
        self,
        cfg: DistillConfig,
        device: str | torch.device | None = None,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        student_tokenizer=None,
        student_path: str = "model.path",
        max_tokens: int = 1024,
    ) -> None:
        if not cfg.teacher_path and model is None:
            raise ValueError("distill.teacher_path is not set; name the teacher checkpoint")
        if model is None:
            mcfg = ModelConfig(path=cfg.teacher_path, device=str(device or "auto"))
            model, tokenizer, _ = load_model_and_tokenizer(mcfg, key="distill.teacher_path")
        if student_tokenizer is not None and tokenizer is not None:
            check_same_tokenizer(tokenizer, str(cfg.teacher_path), student_tokenizer, student_path)
        self.cfg, self.tokenizer, self.max_tokens = cfg, tokenizer, max_tokens
        self.model = model.eval().requires_grad_(False)
        vocab = int(self.model.get_input_embeddings().weight.shape[0])
        if cfg.mode == "topk" and cfg.top_k > vocab:
            raise ValueError(f"distill.top_k {cfg.top_k} exceeds the teacher's vocabulary {vocab}")

    def score(self, sequences: Sequence[Sequence[int]]) -> list[TeacherTargets]:
        """Teacher targets of each token sequence (each of length >= 1), in order."""
        lengths = [len(s) for s in sequences]
        rows = pack_lengths(lengths, max(self.max_tokens, *lengths)) if sequences else []
        out: list[TeacherTargets | None] = [None] * len(sequences)
        device = model_device(self.model)
        kind = self.cfg.mode
        for row in rows:
            ids = torch.cat([torch.as_tensor(sequences[i]) for i in row]).to(device)  # [N]
            lens = torch.tensor([lengths[i] for i in row], device=device)  # [S]
            starts = torch.cumsum(lens, 0) - lens  # [S]
            position_ids = torch.arange(len(ids), device=device) - starts.repeat_interleave(lens)
            with torch.no_grad():
                # attention_mask=None + use_cache=False: position_ids restarting per sample
                # keep the samples apart (facts.md); the trainer's forward does the same
                logits = self.model(
                    input_ids=ids[None],  # [1, N]
                    position_ids=position_ids[None],  # [1, N]
                    attention_mask=None,
                    use_cache=False,
                ).logits[0]  # [N, V]
                token_ids, logprobs = teacher_targets_from_logits(
                    logits, ids, starts, kind, self.cfg.top_k
                )  # [N, K] each
            sizes = lens.tolist()
            split = zip(token_ids.split(sizes), logprobs.split(sizes), strict=True)
            for i, (ids_K, lps_K) in zip(row, split, strict=True):
                out[i] = TeacherTargets(
                    kind=kind, token_ids=ids_K.cpu().numpy(), logprobs=lps_K.cpu().numpy()
                )
        return out  # type: ignore[return-value]  # every index filled: rows cover all samples

    def annotate(self, groups: Sequence[Sequence[RolloutState]]) -> None:
        """Fill ``teacher_targets`` of every COMPLETED sample with input_ids, in place.

        Samples of any other status are left alone: the conversion skips their groups.
        """
        todo = [
            s
            for g in groups
            for s in g
            if s.status == Status.COMPLETED and s.input_ids is not None and s.input_ids.size
        ]
        for s, targets in zip(todo, self.score([s.input_ids for s in todo]), strict=True):
            s.teacher_targets = targets
