from evidence.cli import entry

entry()
