from preflight.cli import command

command()
