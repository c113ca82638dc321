"""``python -m retouch.runtime.executor``: start one executor process."""

from retouch.runtime.executor.main import main

main()
