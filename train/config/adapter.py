"""``model.adapter``: the low-rank adapter a run trains instead of the whole model (train/models/adapter.py applies
it through peft). Only the setting's shape is checked here, when the config loads; whether the model has the named
modules is checked when it is built."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

from train.errors import UserError

ADAPTER_TYPES = ("lora",)
ADAPTER_KEYS = ("type", "r", "alpha", "dropout", "targets")


@dataclass(frozen=True)
class AdapterSettings:
    """``model.adapter`` checked: ``r`` the rank (≥ 1), ``alpha`` the scale numerator (the update is
    ``alpha / r · B A x``), ``dropout`` on the adapter's input (0 ≤ p < 1), ``targets`` ``"auto"`` or module names."""

    type: str = "lora"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: Any = "auto"

    def as_dict(self) -> dict[str, Any]:
        """The settings with every key, as config.yaml keeps them (equal settings written differently compare
        equal on resume: ``alpha: 32`` and ``32.0``, a key left to its default)."""
        return {**asdict(self), "targets": self.targets if self.targets == "auto" else list(self.targets)}

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


def parse_adapter(raw: Any) -> Optional[AdapterSettings]:
    """``model.adapter`` from YAML (None or a mapping) as :class:`AdapterSettings`, or None.

    Raises:
        UserError: not a mapping, an unknown key or type, ``r`` < 1, ``alpha`` ≤ 0, ``dropout`` outside [0, 1),
            ``targets`` neither ``auto`` nor a non-empty list of names — naming ``model.adapter.<key>`` and the fix.
    """
    if raw is None:
        return None
    where = "model.adapter"
    if not isinstance(raw, dict):
        raise UserError(f"{where}={raw!r}: expected a mapping such as {{type: lora, r: 16, alpha: 32, dropout: 0.0, "
                        "targets: auto}}, or leave it out for full fine-tuning")
    unknown = sorted(set(raw) - set(ADAPTER_KEYS))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}: unknown key; {where} takes {', '.join(ADAPTER_KEYS)}")
    s = AdapterSettings(**raw)
    if s.type not in ADAPTER_TYPES:
        raise UserError(f"{where}.type={s.type!r}: supported: {', '.join(ADAPTER_TYPES)}")
    checks = [("r", isinstance(s.r, int) and not isinstance(s.r, bool) and s.r >= 1, "an integer ≥ 1, e.g. 16"),
              ("alpha", isinstance(s.alpha, (int, float)) and not isinstance(s.alpha, bool) and s.alpha > 0,
               "a number > 0, e.g. 32 (twice r)"),
              ("dropout", isinstance(s.dropout, (int, float)) and not isinstance(s.dropout, bool)
               and 0 <= s.dropout < 1, "a probability in [0, 1), e.g. 0.05")]
    for key, ok, want in checks:
        if not ok:
            raise UserError(f"{where}.{key}={getattr(s, key)!r}: expected {want}")
    t = s.targets
    if t != "auto" and not (isinstance(t, (list, tuple)) and t and all(isinstance(x, str) and x for x in t)):
        raise UserError(f"{where}.targets={t!r}: expected auto (the family's attention and MLP projections) or a list "
                        "of module names such as [q_proj, v_proj]")
    return AdapterSettings(s.type, int(s.r), float(s.alpha), float(s.dropout), t if t == "auto" else tuple(t))
