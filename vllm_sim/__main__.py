"""``python -m vllm_sim ...``: same as ``prefix-router sim ...``."""

import sys

from vllm_sim.cli import main

sys.exit(main())
