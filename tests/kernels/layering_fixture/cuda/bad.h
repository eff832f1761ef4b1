// Fixture for layering_test.cmake: CUDA files that include the CPU engine (not built).
#include "core/compact_layout.h"
#include "cpu/engine.h"
#include "kvc/selection.h"
