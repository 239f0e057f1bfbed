"""The `vramcast` command line (`main`), one module per group of commands.

main.py builds the parser and runs `estimate`; options.py holds the job-spec options the
commands share; server.py `serve` and `fit`; store.py `keys` and `db`; trace.py `trace`;
probe.py `probe`. The command line imports the api, store and trace packages, never the reverse.
"""
