/* Everything fabric-ep calls from libfabric. Static-inline functions in these headers
 * (fi_domain, fi_endpoint, fi_writemsg, fi_cq_read, fi_mr_regattr, ...) are exported
 * through bindgen's wrap_static_fns, compiled by cc in build.rs. */
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_tagged.h>
