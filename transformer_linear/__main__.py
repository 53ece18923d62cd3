import sys

from transformer_linear.cli import main

sys.exit(main())
