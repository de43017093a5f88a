"""`python -m dsflash.convert ...` = `dsflash convert ...`."""
import sys

from dsflash.convert.cli import main

sys.exit(main())
