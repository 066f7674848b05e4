"""`python -m xshard ...` is the same as the `xshard` command."""

import sys

from xshard.cli import main

sys.exit(main())
