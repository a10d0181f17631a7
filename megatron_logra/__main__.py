"""``python -m megatron_logra ...`` (and ``torchrun -m megatron_logra ...``)."""

import sys

from megatron_logra.cli import main

sys.exit(main())
