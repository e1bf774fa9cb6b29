import sys

from gemini.cli import main

sys.exit(main())
