"""``python -m ft_assets.cli``: the same as the ``ft-assets`` console script."""

import sys

from ft_assets.cli import main

sys.exit(main())
