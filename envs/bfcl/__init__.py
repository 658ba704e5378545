"""BFCL v4 (the Berkeley Function Calling Leaderboard, from `bfcl-eval`) as an environment.

Rows written from the installed package (export.py), a tool server for every row's own
functions (server.py), BFCL's own checker as an endpoint grader served from BFCL's own
environment (grader_server.py), and what starts them (environment.py); docs/bfcl.md. The
modules that run in BFCL's environment (calls, export, grader_server, bfcl_evaluate) import
only the standard library and bfcl_eval.
"""
