"""MetaSchedule tuning (``kiln tune``) and the committed databases ``kiln compile`` applies."""
