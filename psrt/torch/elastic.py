"""``hvd.elastic``: psrt's elastic training under Horovod's module name (see :mod:`psrt.elastic`)."""
from psrt.elastic import *  # noqa: F401,F403
from psrt.elastic import __all__  # noqa: F401
