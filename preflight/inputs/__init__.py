"""What the user gives, read as the libraries that use it read it: YAML and JSON documents traced to their
lines (documents), accelerate's config, the DeepSpeed config and hostfile (configs), the launch command
(launchcmd), profiles, the inventory of nodes, and the model a memory estimate is for (models).
A file that cannot be read is an InputError: exit 2, one line that names the file and the problem."""
