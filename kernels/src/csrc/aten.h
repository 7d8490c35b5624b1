// The kernels' view of torch: the tensor class, the dispatch macros and the few ATen operators
// they call. Not <ATen/ATen.h>, which declares every operator: parsing it was a third of each
// source's compile time, paid on a machine's first start.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
