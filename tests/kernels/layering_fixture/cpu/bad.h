// Fixture for layering_test.cmake: a CPU file that includes the CUDA backend (not built).
#include "cuda/kernels.h"
#include "kvc/selection.h"
