"""Post-training: a sampler with continuous batching, and the losses of SFT, DPO and GRPO.

``Sampler(model, slots=..., max_length=...).sample(prompts, SamplingParams(...))``
continues prompts on the same model classes training uses (``sampler.py``);
``SamplerGroup`` runs Samplers on Ray actors of their own, fed the trainer's weights
(``remote.py``); ``score`` runs a reward function here or on Ray workers
(``rewards.py``); the losses a user's ``loss`` calls are in ``losses.py``.
"""

from redray.post_training.losses import (dpo_loss, group_advantages, grpo_loss,
                                         logprob_mismatch, masked_mean, preference_pairs,
                                         recomputed_logprobs, sequence_logprobs, sft_loss,
                                         token_logprobs)
from redray.post_training.remote import Pending, SamplerGroup, WeightSync
from redray.post_training.rewards import RewardError, messages, score
from redray.post_training.sampler import Sampler
from redray.post_training.sampling import Completion, SamplingParams, sample_rows

__all__ = ["Completion", "Pending", "RewardError", "Sampler", "SamplerGroup",
           "SamplingParams", "WeightSync", "dpo_loss", "group_advantages", "grpo_loss",
           "logprob_mismatch", "masked_mean", "messages", "preference_pairs", "recomputed_logprobs",
           "sample_rows", "score", "sequence_logprobs", "sft_loss", "token_logprobs"]
