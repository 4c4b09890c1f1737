"""The loss settings: one typed value from the config's `loss.*` keys to the loss formulas.

`LossSettings` is the config tree's `loss` group (`dpojax.config.Config.loss`) and the value the
step carries (`StepConfig.loss`) and `preference_loss` reads: each field holds its default, its
doc, its choices or its range (`dpojax.schema.setting`), so a new loss hyperparameter is a field
here and the formula that reads it (`PairInputs.settings` in `dpojax.train.loss_terms`). The
config check refuses a value outside its range before any compute (`dpojax.config.ranges`), and
`preference_loss` refuses it again for a direct caller (`dpojax.schema.out_of_range`).

Under `jax.jit` the settings are static (a frozen, hashable dataclass); a caller that traces a
number (beta, say) passes `dataclasses.replace(settings, beta=traced)` to the loss directly.
"""

from __future__ import annotations

import dataclasses

from dpojax.schema import FRACTION, NON_NEGATIVE, POSITIVE, Range, setting
from dpojax.train.loss_terms import CPO_TYPES, F_DIVERGENCES, REFERENCE_FREE_LOSSES

F_DIVERGENCE_TYPES: tuple[str, ...] = tuple(F_DIVERGENCES)


def parse_loss_types(text: str) -> tuple[str, ...]:
    """The loss names of a config value: one name, or several joined with "," ("sigmoid,sft")."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The preference loss (docs/losses.md)."""

    type: str = setting(
        "sigmoid",
        "A loss name, or several joined with ',' and weighted by loss.weights; the unpaired "
        "losses kto, apo_zero_unpaired and bco alone (docs/losses.md).",
    )
    weights: tuple = setting((), "One weight per loss type; () = 1 each.")
    beta: float = setting(0.1, "Strength of the implicit KL penalty (> 0).", range=POSITIVE)
    label_smoothing: float = setting(
        0.0, "Probability that a pair's label is flipped.", range=Range(0, 0.5)
    )
    cdpo_smoothing: bool = setting(False, "Conservative DPO: smooth the sigmoid loss's label.")
    f_divergence: str = setting(
        "reverse_kl", "Divergence of the f-DPO family.", choices=F_DIVERGENCE_TYPES
    )
    f_alpha: float = setting(0.5, "Alpha of the alpha-divergence.")
    reference_free: bool = setting(
        False,
        "Use 0 for the reference log-probs: no reference is loaded or run (implied by orpo "
        "and cpo).",
    )
    cpo_type: str = setting(
        "sigmoid", "cpo's preference term (TRL CPOConfig loss_type).", choices=CPO_TYPES
    )
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin gamma (cpo_type=simpo).")
    cpo_alpha: float = setting(
        1.0,
        "Weight of cpo's NLL term on the chosen tokens (0 with simpo: SimPO itself).",
        range=NON_NEGATIVE,
    )
    orpo_lambda: float = setting(
        0.1,
        "ORPO's lambda: weight of the odds-ratio term (TRL ORPOConfig's beta).",
        range=NON_NEGATIVE,
    )
    orpo_nll_prompt: bool = setting(
        True,
        "orpo's NLL over the chosen sequence's prompt and completion tokens, as TRL's "
        "ORPOTrainer (false: the chosen completion tokens only, as the ORPO paper).",
    )
    ld_alpha: float = setting(
        1.0, "LD-DPO weight of the tokens past the shorter completion; 1 = DPO.", range=FRACTION
    )
    use_weighting: bool = setting(False, "WPO: weight each pair by its completions' probability.")
    discopop_tau: float = setting(0.05, "Temperature of the DiscoPOP loss.", range=POSITIVE)
    preference_average_log_probs: bool = setting(
        False, "NeMo: average (not sum) the completion log-probs in the preference loss."
    )
    sft_average_log_probs: bool = setting(
        False, "NeMo: average (not sum) the chosen log-probs in the SFT term."
    )
    preference_loss_weight: float = setting(
        1.0, "NeMo: weight of the preference loss.", range=NON_NEGATIVE
    )
    sft_loss_weight: float = setting(
        0.0, "NeMo: weight of the SFT term on the chosen completion.", range=NON_NEGATIVE
    )
    desirable_weight: float = setting(
        1.0,
        "kto / apo_zero_unpaired: weight of the desirable examples' losses (TRL KTOConfig); 1 "
        "with bco.",
        range=NON_NEGATIVE,
    )
    undesirable_weight: float = setting(
        1.0,
        "kto / apo_zero_unpaired: weight of the undesirable examples' losses (TRL KTOConfig); 1 "
        "with bco.",
        range=NON_NEGATIVE,
    )
    router_aux_loss_coef: float = setting(
        -1.0,
        "Mixture of experts: weight of the load-balancing loss added to the policy's loss; "
        "negative = the model's router_aux_loss_coef when its config sets output_router_logits, "
        "else 0 (as TRL).",
    )

    @property
    def types(self) -> tuple[str, ...]:
        """The loss names of `type`."""
        return parse_loss_types(self.type)

    @property
    def without_reference(self) -> bool:
        """The loss takes the reference log-probs as 0: `reference_free`, or every loss type one
        of the reference-free objectives (orpo, cpo)."""
        types = self.types
        return self.reference_free or bool(types) and set(types) <= REFERENCE_FREE_LOSSES
