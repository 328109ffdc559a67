"""verl's plugin entry point (group ``verl.plugins``, registered by gbc's setup.py).

verl imports every ``verl.plugins`` entry point in every process when ``verl`` is imported
(``VERL_USE_EXTERNAL_PLUGINS``, default ``auto``). Importing this module does nothing unless
``GBC_VERL_ENGINE`` is set to 1 / true / yes: then gbc's engine replaces verl's FSDP actor
engine (:func:`gbc_kernels.integrations.verl_engine.enable`), with the options of
``GBC_VERL_OPTIONS``. verl swallows a plugin's import errors (it logs them at debug level), so
a failure to switch on is reported here as a warning, and the variable
``GBC_VERL_ENGINE=strict`` turns it into an error.
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
