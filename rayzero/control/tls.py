"""The former path of `python -m rayzero.control_api.tls` (certificates for the control service),
kept so that `python -m rayzero.control.tls --out DIR` keeps working."""
from __future__ import annotations

import sys

from rayzero.control_api.tls import main

if __name__ == "__main__":
    sys.exit(main())
