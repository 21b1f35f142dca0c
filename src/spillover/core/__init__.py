"""Pure policy: lifecycle, memory model, ledger, admission, breaker, lanes, fingerprint.

No asyncio, no I/O, no clocks: time is always an argument (``now_s``).
"""
