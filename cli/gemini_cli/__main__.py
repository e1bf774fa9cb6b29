import sys

from gemini_cli import main

sys.exit(main())
