"""The deploy side: facts → planner → operations → runner, behind connectors. Nothing here is imported by runtimes."""
