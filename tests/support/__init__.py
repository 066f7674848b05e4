"""What the tests share, imported as ``support.<module>`` (tests/conftest.py puts tests/ on sys.path).

Not collected by pytest (tests/conftest.py). tests/README.md lists each module and how the
multi-process helpers work.
"""
