// Fixture for layering_test.cmake: a core file that includes a backend and BLAS (not built).
#include <cblas.h>

#include "cpu/pack.h"
#include "kvc/spec.h"
