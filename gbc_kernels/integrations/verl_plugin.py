"""verl's plugin entry point (``verl.plugins``, imported by verl in every process): with
``GBC_VERL_ENGINE`` = 1 / true / yes it runs :func:`.verl_engine.enable`; verl hides a plugin's
import errors, so a failure is a warning here, an error with ``GBC_VERL_ENGINE=strict``.
"""

import os
import warnings

_value = os.environ.get("GBC_VERL_ENGINE", "").strip().lower()
if _value in ("1", "true", "yes", "strict"):
    try:
        from gbc_kernels.integrations.verl_engine import enable as _enable
        _enable()
    except Exception as _e:           # noqa: BLE001 - reported, verl would hide it
        if _value == "strict":
            raise
        warnings.warn(f"GBC_VERL_ENGINE is set but gbc's verl engine could not be enabled: "
                      f"{type(_e).__name__}: {_e}", RuntimeWarning, stacklevel=1)
elif _value not in ("", "0", "false", "no"):
    warnings.warn(f"GBC_VERL_ENGINE={_value!r}: expected 1/true/yes/strict or 0/false/no",
                  RuntimeWarning, stacklevel=1)
