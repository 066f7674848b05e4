"""The launcher module of the framework in support/framework_sft.py (LLaMA-Factory's ``launcher.py`` shape)::

    python -m support.framework_launcher config.yaml
"""

import sys

from support.framework_sft import run_exp

if __name__ == "__main__":
    run_exp(sys.argv[1])
