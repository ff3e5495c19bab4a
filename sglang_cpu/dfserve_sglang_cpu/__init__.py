"""SGLang's own DFLASH engine on CPU: the platform (`platform`) and the hooks (`hooks`) SGLang loads as plugins."""
