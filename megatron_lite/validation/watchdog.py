"""The progress watchdog's flags (config/watchdog.py), checked before any process group exists.

  a watchdog timeout with --no-watchdog       nothing would watch: the flag would be ignored
  MEGATRON_LITE_INJECT_HANG malformed         the drill would silently not run
"""
from __future__ import annotations

import dataclasses
from typing import List

from megatron_lite.config import Config, ConfigError, flag_for
from megatron_lite.config.watchdog import WatchdogConfig


def watchdog_rules(config: Config, notes: List[str]) -> Config:
    from megatron_lite.drills import INJECT_ENV, injected_hangs  # no torch: only the standard library

    w = config.watchdog
    if not w.watchdog:
        changed = [f.name for f in dataclasses.fields(WatchdogConfig)
                   if f.name != "watchdog" and getattr(w, f.name) != f.default]
        if changed:
            raise ConfigError(f"{flag_for(changed[0])} with --no-watchdog sets a timeout nothing watches; drop "
                              f"--no-watchdog, or drop {flag_for(changed[0])}", code="watchdog_flag_without_watchdog")
    try:
        hangs = injected_hangs()
    except ValueError as e:
        raise ConfigError(str(e), code="watchdog_inject_hang") from None
    if hangs and not w.watchdog:
        raise ConfigError(f"{INJECT_ENV} injects a hang with --no-watchdog: nothing would end it; drop "
                          f"--no-watchdog, or unset {INJECT_ENV}", code="watchdog_inject_without_watchdog")
    return config
