"""Other libraries' keys and files, a feature: verl's key=value overrides and config files translated into the
flags (verl), data that is not a small parquet file read through datasets (sources) and prompts of large data
templated once into a cached datasets map (prompt_cache). Loaded only where the command line or the data asks for
it (common.config.cli_args, common.data, common.rollout.load_rl_data)."""
